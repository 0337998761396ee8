"""Manifold-constrained hyper-connections: the residual stream is `hc` parallel streams.

Shapes: T = tokens, N = hc_mult streams, D = hidden size. Entering a block, the N
streams collapse into one input (weights `pre`); leaving it, the block's output is
spread back over the streams (`post`) and added to the streams mixed by `comb`, a
doubly-stochastic N x N matrix (Sinkhorn-Knopp), so the residual never grows.
All three weights come from one small projection of the normalised streams, in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.shared.kernels.dispatch import use_triton
from moemesh.shared.kernels.hyper import hc_merge, hc_mix
from moemesh.shared.kernels.v4_rope import unit_rms_ref as unit_rms


class HyperConnection(nn.Module):
    def __init__(self, hc: int, hidden: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc) * hc  # pre (N), post (N), comb (N*N)
        self.fn = nn.Parameter(torch.empty(width, hc * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (post [T, N], comb [T, N, N], collapsed input [T, D])."""
        if use_triton(streams):  # one GEMM and one kernel (shared/kernels/hyper.py), for ~135 ops here
            mixes = F.linear(streams.flatten(1).float(), self.fn.float())
            return hc_mix(mixes, streams, self.base, self.scale, self.iters, self.hc_eps, self.norm_eps)
        T, N = streams.shape[:2]
        mixes = F.linear(unit_rms(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.base.split([N, N, N * N])
        s_pre, s_post, s_comb = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(T, N, N) * s_comb + comb_b.view(N, N), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The block's output spread over the streams plus the mixed streams. comb is read
    transposed (new stream k = sum_j comb[j, k] * stream j): Sinkhorn's result is not
    symmetric, so the direction matters. (shared/kernels/hyper.py: one kernel, or this
    in torch.)"""
    return hc_merge(streams, out, post, comb)


class HyperHead(nn.Module):
    """Collapses the streams once more before the final norm and the LM head."""

    def __init__(self, hc: int, hidden: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc, hc * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, N, D] -> [T, D]."""
        if use_triton(streams):
            mixes = F.linear(streams.flatten(1).float(), self.hc_fn.float())
            return hc_mix(mixes, streams, self.hc_base, self.hc_scale, 0, self.hc_eps, self.norm_eps, full=False)
        mixes = F.linear(unit_rms(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
