"""Verification of MTP draft tokens against the target model.

The draft proposes greedily (a one-hot distribution q), so the standard speculative
sampling rule reduces to: accept draft d with probability p(d); on rejection, draw from
p with d removed. The output distribution is exactly the target's, and for greedy
requests the output equals plain greedy decoding token for token.
"""

from __future__ import annotations

import torch

from moemesh.shared.engine.sampler import draw, processed_probs
from moemesh.shared.protocol.sampling import SamplingParams


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
    rows, row_params, firsts = [], [], []
    for r0, ds, p in zip(starts, drafts, params):
        firsts.append(len(rows))
        rows += range(r0, r0 + len(ds) + 1)
        row_params += [p] * (len(ds) + 1)
    probs = processed_probs(logits[rows] if rows != list(range(logits.shape[0])) else logits, row_params)
    at = [f + j for f, ds in zip(firsts, drafts) for j in range(len(ds))]
    p_draft = probs[at, [d for ds in drafts for d in ds]].tolist() if at else []
    shared = torch.rand(len(at), dtype=torch.float64).tolist() if at else []
    out, last_rows, zero_at, zero_tok = [], [], [], []
    k = 0
    for i, (ds, g) in enumerate(zip(drafts, generators)):
        u = torch.rand(len(ds), generator=g, dtype=torch.float64).tolist() if g is not None and ds \
            else shared[k : k + len(ds)]
        n = 0
        while n < len(ds) and u[n] < p_draft[k + n]:  # draft n accepted with probability p(d)
            n += 1
        k += len(ds)
        out.append(ds[:n])
        last_rows.append(firsts[i] + n)
        if n < len(ds):  # rejected: the last token is drawn from p without the draft
            zero_at.append(i)
            zero_tok.append(ds[n])
    last = probs[last_rows]
    if zero_at:
        last[zero_at, zero_tok] = 0
    total = last.sum(dim=-1)
    empty = (total <= 0).tolist()  # p was one-hot on the rejected draft: rejection had probability 0
    toks = draw(last / total.clamp(min=1e-30)[:, None], generators).tolist()
    for i, (o, t) in enumerate(zip(out, toks)):
        o.append(zero_tok[zero_at.index(i)] if empty[i] else t)
    return out
