"""The lightning indexer's scores in one launch: each query row against the index keys
of its own sequence, read where they lie in the cache, masked past what the row sees.

Shapes: R = rows, h = indexer heads, w = index head width, E = entries. score[r, e] =
sum_h wts[r, h] * relu(q[r, h] . key_e) * w^-0.5, with key_e at (table[r, e // per_block],
e % per_block) of the index-key view, and -inf where e >= visible[r]. The top-k that
follows is one torch.topk. In torch that is ~12 launches and a gathered [R, E, w] copy
of the keys.
"""

from __future__ import annotations

import torch

from moemesh.shared.kernels._triton import jit, next_pow2, tl
from moemesh.shared.kernels.dispatch import use_triton


def index_scores_ref(q: torch.Tensor, wts: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
                     visible: torch.Tensor, count: int) -> torch.Tensor:
    """q [R, h, w] (rotated), wts [R, h] (already times h^-0.5), keys [blocks, per_block, w]
    -> [R, count] fp32, -inf past each row's visible entries."""
    per_block = keys.shape[1]
    e = torch.arange(count, device=q.device)
    k = keys[table[:, e // per_block], (e % per_block)[None, :]].float()  # [R, E, w]
    s = torch.relu(torch.einsum("rhd,red->rhe", q.float(), k)) * q.shape[-1] ** -0.5
    s = (s * wts.float().unsqueeze(-1)).sum(dim=1)
    return s.masked_fill(e[None, :] >= visible[:, None], float("-inf"))


@jit
def _index_scores_kernel(
    q_ptr, w_ptr, k_ptr, table_ptr, vis_ptr, out_ptr, nh, width, E, per_block, scale,
    stride_qr, stride_qh, stride_wr, stride_kb, stride_ks, stride_table, stride_out,
    PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_E: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    em = e < E
    h = tl.arange(0, BLOCK_H)
    hm = h < nh
    c = tl.arange(0, BLOCK_W)
    cm = c < width
    q = tl.load(q_ptr + r * stride_qr + h[:, None] * stride_qh + c[None, :], mask=hm[:, None] & cm[None, :],
                other=0.0).to(tl.float32)
    wt = tl.load(w_ptr + r * stride_wr + h, mask=hm, other=0.0).to(tl.float32)
    blk = tl.load(table_ptr + r * stride_table + e // per_block, mask=em, other=0).to(tl.int64)
    k = tl.load(k_ptr + blk[:, None] * stride_kb + (e % per_block)[:, None] * stride_ks + c[None, :],
                mask=em[:, None] & cm[None, :], other=0.0).to(tl.float32)
    s = tl.maximum(tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0) * scale  # [h, e]
    score = tl.sum(s * wt[:, None], axis=0)
    vis = tl.load(vis_ptr + r)
    tl.store(out_ptr + r * stride_out + e, tl.where(e < vis, score, float("-inf")), mask=em)


def index_scores(q: torch.Tensor, wts: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, visible: torch.Tensor,
                 count: int) -> torch.Tensor:
    """Same contract as index_scores_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run the kernel."""
    if not use_triton(q):
        return index_scores_ref(q, wts, keys, table, visible, count)
    R, nh, width = q.shape
    if keys.shape[-1] != width or keys.stride(-1) != 1 or table.shape[0] != R or wts.shape != (R, nh):
        raise ValueError(f"index_scores: q {tuple(q.shape)}, wts {tuple(wts.shape)}, keys {tuple(keys.shape)}, "
                         f"table {tuple(table.shape)} do not fit")
    q, wts, table = q.float().contiguous(), wts.float().contiguous(), table.contiguous()
    out = torch.empty(R, count, dtype=torch.float32, device=q.device)
    if R and count:
        block_e = 64
        _index_scores_kernel[(R, -(-count // block_e))](
            q, wts, keys, table, visible.contiguous(), out, nh, width, count, keys.shape[1], width ** -0.5,
            q.stride(0), q.stride(1), wts.stride(0), keys.stride(0), keys.stride(1), table.stride(0), out.stride(0),
            PRECISION="ieee", BLOCK_H=max(16, next_pow2(nh)), BLOCK_W=max(16, next_pow2(width)), BLOCK_E=block_e,
        )
    return out
