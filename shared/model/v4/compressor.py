"""Compressors and the lightning indexer of CSA / HCA layers.

A compressor pools each group of `m` positions into one entry: per channel, a softmax
over the group of (gate projection + a learned per-slot bias) weights the kv
projections; the sum is RMS-normalised and rotated at the group's first position.
CSA's compressor overlaps groups: each position projects two series, Ca (for the next
group's entry) and Cb (for its own), so entry w pools group w-1's Ca with group w's Cb
over 2m slots; before position 0 the slots are empty (weight 0).

The indexer runs its own smaller CSA-style compressor (index keys) and scores a query
t against entry s as sum_h w_{t,h} * relu(q_{t,h} . k_s) (paper §2.3.1); a query keeps
its top `index_topk` entries among those it may see, (t + 1) // m of them.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.shared.kernels.v4_compress import compress, pool_ref
from moemesh.shared.kernels.v4_indexer import index_scores
from moemesh.shared.model.layers import RMSNorm
from moemesh.shared.model.v4.batch import Groups
from moemesh.shared.model.v4.rope import Rope, rotate


class Compressor(nn.Module):
    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        series = 2 if overlap else 1
        self.kv_proj = nn.Linear(hidden, series * width, bias=False)
        self.gate_proj = nn.Linear(hidden, series * width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, series * width, dtype=torch.float32))
        self.kv_norm = RMSNorm(width, eps, fp32_weight=True)

    @property
    def proj_width(self) -> int:
        return 2 * self.kv_proj.out_features

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """[T, D] -> [T, kv | gate], what the window keeps per position."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def pool(self, ctx_proj: torch.Tensor, groups: Groups, rope: Rope) -> torch.Tensor:
        """ctx_proj: projections of the batch's rows then of its pre positions.
        Returns the groups' entries [G, width], normalised and rotated."""
        pooled = pool_ref(ctx_proj, groups.idx, self.position_bias, self.rate, self.width, self.overlap)
        cos, sin = rope.angles(groups.pos)
        return rotate(self.kv_norm(pooled), cos, sin)

    def compress(self, proj: torch.Tensor, ring: torch.Tensor, pre_ring: torch.Tensor, pre_slot: torch.Tensor,
                 groups: Groups, rope: Rope, store: torch.Tensor) -> None:
        """pool() from where the projections lie (the batch's rows `proj`, earlier ones in
        `ring` at (pre_ring, pre_slot)) into store[blk, slot]: one kernel on the kernel
        path (shared/kernels/v4_compress.py)."""
        compress(proj, ring, pre_ring, pre_slot, groups.idx, groups.pos, groups.blk, groups.slot,
                 self.position_bias, self.kv_norm.weight, self.kv_norm.eps, rope.inv_freq, rope.attention_factor,
                 self.rate, self.overlap, store)


class Scorer(nn.Module):
    def __init__(self, hidden: int, n_heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


class Indexer(Compressor):
    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, rate: int, topk: int,
                 eps: float):
        super().__init__(hidden, head_dim, rate, overlap=True, eps=eps)
        self.n_heads, self.topk = n_heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.scorer = Scorer(hidden, n_heads)

    def scores(self, q_res: torch.Tensor, x: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, wts: torch.Tensor | None = None) -> torch.Tensor:
        """Rows' queries against index keys: keys [R, E, d] (one set per row) or [E, d]
        (shared by all rows). Returns [R, E] in fp32. wts: the rows' head weights, where
        the caller projected them with others (V4Attention.fuse); else from x."""
        R = q_res.shape[0]
        q = rotate(self.q_b_proj(q_res).view(R, self.n_heads, self.width), cos, sin).float()
        if keys.dim() == 3:
            s = torch.einsum("rhd,red->rhe", q, keys.float())
        else:
            s = torch.einsum("rhd,ed->rhe", q, keys.float())
        s = torch.relu(s) * self.width**-0.5
        w = (self.scorer.weights_proj(x) if wts is None else wts).float() * self.n_heads**-0.5
        return (s * w.unsqueeze(-1)).sum(dim=1)

    def pick(self, q_res: torch.Tensor, x: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             keys: torch.Tensor, entries, wts: torch.Tensor | None = None) -> torch.Tensor:
        """Decode rows on the kernel path: each row's top-k entry ids, scored against the
        index keys where they lie (`keys` [blocks, per_block, d], `entries` the rows'
        Entries); the ids past a row's visible entries are picked last, and masked by
        whoever reads them."""
        R = q_res.shape[0]
        q = rotate(self.q_b_proj(q_res).view(R, self.n_heads, self.width), cos, sin)
        wts = (self.scorer.weights_proj(x) if wts is None else wts).float() * self.n_heads**-0.5
        scores = index_scores(q, wts, keys, entries.table, entries.visible, entries.count)
        return scores.topk(min(self.topk, entries.count), dim=-1).indices

    def select(self, scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k among the entries it may see: (indices [R, k], valid [R, k])."""
        E = scores.shape[1]
        hidden = torch.arange(E, device=scores.device)[None, :] >= visible[:, None]
        k = min(self.topk, E)
        top = scores.masked_fill(hidden, float("-inf")).topk(k, dim=-1).indices
        return top, top < visible[:, None]
