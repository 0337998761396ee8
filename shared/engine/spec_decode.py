"""Verification of MTP draft tokens against the target model.

The draft proposes greedily (a one-hot distribution q), so the standard speculative
sampling rule reduces to: accept draft d with probability p(d); on rejection, draw from
p with d removed. The output distribution is exactly the target's, and for greedy
requests the output equals plain greedy decoding token for token.
"""

from __future__ import annotations

import torch

from moemesh.shared.engine.sampler import processed_probs
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
    probs = processed_probs(target_logits, [params] * target_logits.shape[0])
    out = []
    for j, d in enumerate(drafts):
        u = torch.rand(1, generator=generator).item()
        if u < float(probs[j, d]):
            out.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0
        total = residual.sum()
        if total <= 0:  # p was one-hot on d, so rejection had probability 0
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out
