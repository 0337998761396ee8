import torch

from moemesh.shared.protocol.sampling import SamplingParams
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
