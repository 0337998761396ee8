"""Verification of MTP draft tokens against the target model.

The draft proposes greedily (a one-hot distribution q), so the standard speculative
sampling rule reduces to: accept draft d with probability p(d); on rejection, draw from
p with d removed. The output distribution is exactly the target's, and for greedy
requests the output equals plain greedy decoding token for token.
"""

from __future__ import annotations

import torch

from moemesh.shared.engine.host_copy import to_device
from moemesh.shared.engine.sampler import draw_with, processed_probs, uniforms
from moemesh.shared.protocol.messages import SamplingParams


def accept_greedy(best: list[int], drafts: list[int]) -> list[int]:
    """Greedy verification from the target's argmax at each of the k+1 rows: the drafts
    up to the first that differs, then the target's own token there."""
    out = []
    for j, d in enumerate(drafts):
        if best[j] != d:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def verify(
    target_logits: torch.Tensor,  # [k+1, V]: row j scores the token after draft j-1
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """Returns the accepted drafts followed by one token from the target (1..k+1 tokens)."""
    if params.greedy:
        return accept_greedy(target_logits.argmax(dim=-1).tolist(), drafts)
    return verify_many(target_logits, [0], [drafts], [params], [generator])[0]


def verify_many(
    logits: torch.Tensor,  # [rows, V]: each sequence's k+1 rows from its start
    starts: list[int],
    drafts: list[list[int]],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[list[int]]:
    """verify() for many sampled (not greedy) sequences at once: one pass of temperature,
    top-k and top-p over all their rows, one gather of the drafts' probabilities and one
    draw for every sequence's last token, where a sequence at a time took a softmax, a
    sort and a draw of its own (the MTP step's largest host cost at a few hundred
    sampled sequences). A seeded sequence draws from its own generator only, so what it
    gets does not depend on what it was verified with."""
    if not starts:
        return []
    k = max(len(ds) for ds in drafts)
    ids = to_device([ds + [0] * (k - len(ds)) for ds in drafts], torch.long, logits.device)
    accepted, last = verify_tensors(logits, starts, [len(ds) for ds in drafts], ids, params, generators)
    return [ds[:a] + [t] for ds, a, t in zip(drafts, accepted.tolist(), last.tolist())]


def verify_tensors(
    logits: torch.Tensor,  # [rows, V]: each sequence's 1 + num_drafts rows from its start
    starts: list[int],
    num_drafts: list[int],
    draft_ids: torch.Tensor,  # [sequences, K] on the logits' device: a sequence's first num_drafts are its drafts
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verification of greedy and sampled sequences with its outcome left where the
    logits are: (accepted [sequences], the target's last token [sequences]), on their
    device. Nothing is read back, so on a GPU it is queued work like the forward's, and
    the step's one wait reads the outcome with the sampled ids. The draws' numbers come
    from the host's generators, as draw()'s do (the same numbers in the same order as a
    sequence verified alone: a seeded sequence's tokens never depend on its batch)."""
    dev = logits.device
    C, K = len(starts), draft_ids.shape[1]
    accepted = torch.zeros(C, dtype=torch.long, device=dev)
    last = torch.zeros(C, dtype=torch.long, device=dev)
    nd = to_device(num_drafts, torch.long, dev)
    cols = torch.arange(K, device=dev)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        g = to_device(greedy, torch.long, dev)
        at = to_device([starts[i] for i in greedy], torch.long, dev)[:, None] \
            + torch.arange(K + 1, device=dev)
        best = logits.argmax(dim=-1)[at.clamp(max=logits.shape[0] - 1)]  # [G, K + 1]
        match = (best[:, :K] == draft_ids[g]) & (cols < nd[g][:, None])
        a = match.long().cumprod(dim=1).sum(dim=1)
        accepted[g] = a
        last[g] = best.gather(1, a[:, None]).squeeze(1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        s = to_device(sampled, torch.long, dev)
        a, t = _verify_sampled(logits, [starts[i] for i in sampled], [num_drafts[i] for i in sampled], draft_ids[s],
                               [params[i] for i in sampled], [generators[i] for i in sampled])
        accepted[s], last[s] = a, t
    return accepted, last


def _verify_sampled(logits, starts, num_drafts, draft_ids, params, generators):
    """verify_tensors for sampled sequences: accept draft d with probability p(d) (drafts
    in order); the last token from p, with the rejected draft removed."""
    dev = logits.device
    S, K = len(starts), draft_ids.shape[1]
    rows, row_params, firsts = [], [], []
    for r0, n, p in zip(starts, num_drafts, params):
        firsts.append(len(rows))
        rows += range(r0, r0 + n + 1)
        row_params += [p] * (n + 1)
    sel = logits if rows == list(range(logits.shape[0])) else logits[to_device(rows, torch.long, dev)]
    probs = processed_probs(sel, row_params)
    seq_of = [i for i, n in enumerate(num_drafts) for _ in range(n)]
    col_of = [j for n in num_drafts for j in range(n)]
    nd = to_device(num_drafts, torch.long, dev)
    firsts_t = to_device(firsts, torch.long, dev)
    if seq_of:
        # The numbers: every draft's from the global generator, then a seeded sequence's
        # own from its generator (verify()'s order, which the seeded results depend on).
        u = torch.rand(len(seq_of), dtype=torch.float64)
        k = 0
        for n, g in zip(num_drafts, generators):
            if g is not None and n:
                u[k : k + n] = torch.rand(n, generator=g, dtype=torch.float64)
            k += n
        si = to_device(seq_of, torch.long, dev)
        cj = to_device(col_of, torch.long, dev)
        d = draft_ids[si, cj]
        p_draft = probs[firsts_t[si] + cj, d].double()
        ok = torch.zeros(S, K, dtype=torch.long, device=dev)
        ok[si, cj] = (u.to(dev, non_blocking=True) < p_draft).long()
        a = ok.cumprod(dim=1).sum(dim=1)
    else:
        a = torch.zeros(S, dtype=torch.long, device=dev)
    last = probs[firsts_t + a]
    rejected = a < nd
    d_rej = None
    if K:
        d_rej = draft_ids.gather(1, a.clamp(max=K - 1)[:, None])  # [S, 1]: the rejected draft, where one was
        kept = last.gather(1, d_rej)
        last.scatter_(1, d_rej, torch.where(rejected[:, None], torch.zeros_like(kept), kept))
    total = last.sum(dim=-1)
    tok = draw_with(last / total.clamp(min=1e-30)[:, None], uniforms(generators))
    if d_rej is not None:  # p was one-hot on the rejected draft: rejection had probability 0
        tok = torch.where(rejected & (total <= 0), d_rej[:, 0], tok)
    return a, tok
