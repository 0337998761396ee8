import torch

from moemesh.shared.protocol.messages import SamplingParams
from moemesh.shared.engine.spec_decode import verify


def _logits(best: list[int], vocab=10):
    x = torch.zeros(len(best), vocab)
    for i, b in enumerate(best):
        x[i, b] = 5.0
    return x


def test_greedy_accepts_matching_prefix_then_corrects():
    g = SamplingParams(temperature=0)
    assert verify(_logits([3, 4, 5]), [3, 4], g, None) == [3, 4, 5]  # all accepted + bonus
    assert verify(_logits([3, 9, 5]), [3, 4], g, None) == [3, 9]  # second rejected, corrected
    assert verify(_logits([8, 4, 5]), [3, 4], g, None) == [8]
    assert verify(_logits([2]), [], g, None) == [2]


def test_sampled_verification_preserves_the_target_distribution():
    # Target p over 3 tokens; draft always proposes token 0. The output must follow p.
    p = torch.tensor([0.2, 0.5, 0.3])
    logits = torch.log(p).repeat(2, 1)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    n = 6000
    for _ in range(n):
        counts[verify(logits, [0], params, gen)[0]] += 1
    assert torch.allclose(counts / n, p, atol=0.03)


def test_many_sequences_verified_at_once_each_follow_their_target():
    """verify_many over a batch of sequences with 0-2 drafts each (a draft of high, low or
    zero target probability), temperatures and top-k apart: each sequence's first token
    follows its own target distribution, and its acceptance of the draft the rule's p(d)."""
    from moemesh.shared.engine.spec_decode import verify_many

    p = torch.tensor([[0.2, 0.5, 0.3, 0.0], [0.7, 0.1, 0.1, 0.1], [0.0, 0.0, 1.0, 0.0]])
    logits = torch.log(p.clamp(min=1e-12))
    # seq 0 drafts 1 (p=.5) on target row 0; seq 1 drafts 3 (p=.1) then 0 on rows 1 and 0;
    # seq 2 drafts nothing; seq 3 drafts 2 where p is one-hot on it (never rejected).
    rows = torch.cat([logits[[0, 0]], logits[[1, 0, 1]], logits[[0]], logits[[2, 0]]])
    starts, drafts = [0, 2, 5, 6], [[1], [3, 0], [], [2]]
    params = [SamplingParams(temperature=1.0)] * 4
    n, first = 4000, torch.zeros(4, 4)
    accepted = torch.zeros(4)
    torch.manual_seed(0)
    for _ in range(n):
        out = verify_many(rows, starts, drafts, params, [None] * 4)
        for i, o in enumerate(out):
            first[i, o[0]] += 1
            accepted[i] += len(o) - 1 > 0
            assert 1 <= len(o) <= len(drafts[i]) + 1
    assert torch.allclose(first[0] / n, p[0], atol=0.03)  # the first token of each follows its first row
    assert torch.allclose(first[1] / n, p[1], atol=0.03)
    assert torch.allclose(first[2] / n, p[0], atol=0.03)
    assert first[3, 2] == n and accepted[3] == n  # a one-hot target never rejects its draft
    assert abs(accepted[0] / n - 0.5) < 0.03 and abs(accepted[1] / n - 0.1) < 0.02


def test_a_seeded_sequence_gets_the_same_tokens_whatever_it_is_verified_with():
    from moemesh.shared.engine.spec_decode import verify_many

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.8, top_k=20)

    def gen():
        return torch.Generator().manual_seed(42)

    alone = verify_many(logits[3:6], [0], [[7, 8]], [params], [gen()])[0]
    for _ in range(3):
        batched = verify_many(logits, [0, 3], [[1, 2], [7, 8]], [params, params], [None, gen()])[1]
        assert batched == alone


def test_verification_left_on_the_device_equals_the_host_rule():
    """verify_tensors (the overlapped MTP step's, which reads nothing back) gives each
    sequence of a mixed batch, greedy and sampled, seeded or not, with 0-3 drafts, what
    accept_greedy or verify_many gives it alone."""
    import random

    from moemesh.shared.engine.spec_decode import accept_greedy, verify_many, verify_tensors

    rnd = random.Random(0)
    for trial in range(60):
        nds = [rnd.randint(0, 3) for _ in range(rnd.randint(1, 6))]
        starts = [sum(n + 1 for n in nds[:i]) for i in range(len(nds))]
        V = rnd.choice([5, 50])
        logits = torch.randn(starts[-1] + nds[-1] + 1, V, generator=torch.Generator().manual_seed(trial)) * 3
        best = logits.argmax(-1).tolist()
        # drafts: the target's argmax or not, so that some are accepted and some rejected
        drafts = [[best[s + j] if rnd.random() < 0.6 else rnd.randrange(V) for j in range(n)]
                  for s, n in zip(starts, nds)]
        params = [SamplingParams(temperature=0) if rnd.random() < 0.4 else
                  SamplingParams(temperature=rnd.choice([0.7, 1.0]), top_k=rnd.choice([0, 4])) for _ in nds]
        seeds = [rnd.randrange(100) for _ in nds]
        K = max(max(nds), 1)
        ids = torch.tensor([d + [0] * (K - len(d)) for d in drafts])
        gens = [None if p.greedy else torch.Generator().manual_seed(s) for p, s in zip(params, seeds)]
        acc, last = verify_tensors(logits, starts, nds, ids, params, gens)
        for i, (s, n, p) in enumerate(zip(starts, nds, params)):
            got = drafts[i][: int(acc[i])] + [int(last[i])]
            if p.greedy:
                want = accept_greedy(best[s : s + n + 1], drafts[i])
            else:
                want = verify_many(logits[s : s + n + 1], [0], [drafts[i]], [p],
                                   [torch.Generator().manual_seed(seeds[i])])[0]
            assert got == want, (trial, i)
