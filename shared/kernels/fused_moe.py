"""Routed-expert computation: tokens go to their top-k experts and come back weighted.

T = tokens, D = hidden, I = expert intermediate size, S = expert slots held here,
K = experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_ref(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [S, 2I, D] gate rows then up rows
    w2: torch.Tensor,  # [S, D, I]
    topk_ids: torch.Tensor,  # [T, K] slot ids in [0, S); -1 means "not here"
    topk_weights: torch.Tensor,  # [T, K]
) -> torch.Tensor:
    """Plain-torch reference: sort the (token, k) pairs by slot, run each slot's FFN once."""
    T, K = topk_ids.shape
    out = torch.zeros_like(x)
    if T == 0:
        return out
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    start = int((sorted_ids < 0).sum())
    counts = torch.bincount(sorted_ids[start:], minlength=w13.shape[0]).tolist()
    tok = order // K
    kpos = order % K
    inter = w13.shape[1] // 2
    for slot, n in enumerate(counts):
        if n == 0:
            continue
        idx = slice(start, start + n)
        start += n
        t = tok[idx]
        h = F.linear(x[t], w13[slot])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, w2[slot]) * topk_weights[t, kpos[idx], None].to(x.dtype)
        out.index_add_(0, t, y)
    return out
