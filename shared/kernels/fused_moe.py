"""Routed-expert computation: tokens go to their top-k experts and come back weighted.

T = tokens, D = hidden, I = expert intermediate size, S = expert slots held here,
K = experts per token.

Rounding: each expert's output rounds to x's dtype, as its GEMM leaves it; the routing
weights stay in fp32 and a token's weighted outputs are summed in fp32 and rounded once
(transformers' grouped experts do the same). Rounding the weight and each product to
bf16 first added two roundings a pair.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moemesh.shared.kernels._triton import jit, next_pow2, tl
from moemesh.shared.kernels.dispatch import use_triton


def fused_moe_ref(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [S, 2I, D] gate rows then up rows
    w2: torch.Tensor,  # [S, D, I]
    topk_ids: torch.Tensor,  # [T, K] slot ids in [0, S); -1 means "not here"
    topk_weights: torch.Tensor,  # [T, K]
    limit: float | None = None,
) -> torch.Tensor:
    """Plain-torch reference: sort the (token, k) pairs by slot, run each slot's FFN once.
    limit: DeepSeek-V4's SwiGLU clipping, gate <= limit and |up| <= limit before the product."""
    T, K = topk_ids.shape
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # the weighted sum, rounded once at the end
    if T == 0:
        return out.to(x.dtype)
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
        gate, up = h[:, :inter], h[:, inter:]
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        h = F.silu(gate) * up
        y = F.linear(h, w2[slot]).float() * topk_weights[t, kpos[idx], None].float()
        out.index_add_(0, t, y)
    return out.to(x.dtype)


# ---- Triton path -----------------------------------------------------------------
# The (token, k) pairs are sorted by slot and each slot's run is padded to a multiple of
# BLOCK_M, so every M-block of the grouped GEMM belongs to one slot. The grid is sized
# for the worst case (every slot in use ends on a partial block; at most min(S, P) are
# in use) so that no count has to come back to the host; blocks past the end see slot
# -1 and exit at once.
# P = T * K pairs, M = padded rows.


def moe_align_ref(topk_ids: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (sorted_pairs [M] pair index t*K+k or P for padding, block_slot [M / block_m] or -1).
    About twenty torch ops; moe_align does it in one launch."""
    flat = topk_ids.reshape(-1)
    P = flat.numel()
    max_rows = (-(-P // block_m) + min(num_slots, P)) * block_m
    key = torch.where(flat >= 0, flat, num_slots)  # pairs held elsewhere sort last, then drop
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_slots]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    held = sorted_key < num_slots
    k = torch.where(held, sorted_key, 0)
    rank = torch.arange(P, device=flat.device) - starts[k]
    dest = torch.where(held, padded_end[k] - padded[k] + rank, max_rows)  # row max_rows is a bin
    sorted_pairs = torch.full((max_rows + 1,), P, dtype=torch.int64, device=flat.device)
    sorted_pairs.scatter_(0, dest, order)
    block_start = torch.arange(0, max_rows, block_m, device=flat.device)
    block_slot = torch.searchsorted(padded_end, block_start, right=True)
    block_slot = torch.where(block_slot < num_slots, block_slot, -1)
    return sorted_pairs[:max_rows], block_slot


@jit
def _moe_align_kernel(
    ids_ptr, pairs_ptr, block_slot_ptr, P, S, max_rows, block_m,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program: a counting sort of the P pairs by slot, each slot's run padded to a
    multiple of block_m. Pairs keep their order within a slot, as the stable sort does."""
    s = tl.arange(0, BLOCK_S)
    sm = s < S
    i = tl.arange(0, BLOCK_P)
    counts = tl.zeros([BLOCK_S], dtype=tl.int64)
    for p0 in range(0, P, BLOCK_P):
        key = tl.load(ids_ptr + p0 + i, mask=p0 + i < P, other=-1)
        counts += tl.sum((key[:, None] == s[None, :]).to(tl.int64), axis=0)
    padded = tl.where(sm, (counts + block_m - 1) // block_m * block_m, 0)
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    for r0 in range(0, max_rows, BLOCK_P):
        tl.store(pairs_ptr + r0 + i, tl.full([BLOCK_P], P, dtype=tl.int64), mask=r0 + i < max_rows)
    tl.debug_barrier()  # the padding is down before any pair lands on it
    running = tl.zeros([BLOCK_S], dtype=tl.int64)
    for p0 in range(0, P, BLOCK_P):
        pm = p0 + i < P
        key = tl.load(ids_ptr + p0 + i, mask=pm, other=-1)
        hit = (key[:, None] == s[None, :]) & sm[None, :]  # [pairs, slots], one-hot (none: held elsewhere)
        earlier = tl.sum(((key[:, None] == key[None, :]) & (i[None, :] < i[:, None])).to(tl.int64), axis=1)
        base = tl.sum(tl.where(hit, (padded_start + running)[None, :], 0), axis=1)
        held = pm & (tl.sum(hit.to(tl.int64), axis=1) > 0)
        tl.store(pairs_ptr + base + earlier, (p0 + i).to(tl.int64), mask=held)
        running += tl.sum(hit.to(tl.int64), axis=0)
    for b0 in range(0, max_rows // block_m, BLOCK_P):
        b = b0 + i
        slot = tl.sum(((padded_end[None, :] <= (b * block_m)[:, None]) & sm[None, :]).to(tl.int64), axis=1)
        tl.store(block_slot_ptr + b, tl.where(slot < S, slot, -1), mask=b < max_rows // block_m)


def moe_align(topk_ids: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as moe_align_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run the kernel."""
    if not use_triton(topk_ids):
        return moe_align_ref(topk_ids, num_slots, block_m)
    flat = topk_ids.reshape(-1).contiguous()
    P = flat.numel()
    max_rows = (-(-P // block_m) + min(num_slots, P)) * block_m
    pairs = torch.empty(max_rows, dtype=torch.int64, device=flat.device)
    block_slot = torch.empty(max_rows // block_m, dtype=torch.int64, device=flat.device)
    if max_rows:
        block_p, block_s, warps = align_tiles(num_slots)
        _moe_align_kernel[(1,)](flat, pairs, block_slot, P, num_slots, max_rows, block_m,
                                BLOCK_P=block_p, BLOCK_S=block_s, num_warps=warps)
    return pairs, block_slot


def align_tiles(num_slots: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_S, num_warps): [pairs, slots] tiles of at most 8k entries and
    [pairs, pairs] of at most 4k, which compile for sm_90 without spills at 256 experts
    (tests/kernels/compile_check.py)."""
    block_s = next_pow2(num_slots + 1)
    return max(16, min(64, 8192 // block_s)), block_s, 8


@jit
def _fused_moe_kernel(
    a_ptr, w_ptr, out_ptr, pairs_ptr, block_slot_ptr,
    N, Kdim, num_pairs, top_k, gate_up_offset, limit,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    GATE_UP: tl.constexpr, CLAMP: tl.constexpr, A_PER_TOKEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of one slot's GEMM. GATE_UP: out = silu(a Wg^T) * (a Wu^T),
    with Wu `gate_up_offset` rows below Wg (CLAMP: gate <= limit, |up| <= limit first).
    Else: out = a W^T (the combine applies the routing weight)."""
    pid_m = tl.program_id(0)
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    if slot < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    mmask = pair < num_pairs
    a_row = pair // top_k if A_PER_TOKEN else pair
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + slot * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, Kdim, BLOCK_K):
        kmask = offs_k < Kdim - k0
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATE_UP:
            wu = tl.load(w_ptrs + gate_up_offset * stride_wn, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc2 = tl.dot(a, wu, acc2, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    dtype = out_ptr.dtype.element_ty
    # Round where the reference's separate ops round, so low precision tracks it closely.
    if GATE_UP:
        g = acc.to(dtype).to(tl.float32)
        u = acc2.to(dtype).to(tl.float32)
        if CLAMP:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        g = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        res = g * u
    else:
        res = acc
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], res.to(dtype),
             mask=mmask[:, None] & nmask[None, :])


@jit
def _moe_combine_kernel(
    y_ptr, ids_ptr, w_ptr, out_ptr, D, top_k, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[t] = sum over k of weight[t, k] * y[t*K + k] in fp32, rounded once, skipping
    pairs whose slot is -1 (never written)."""
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ks = tl.arange(0, BLOCK_K)
    held = (ks < top_k) & (tl.load(ids_ptr + t * top_k + ks, mask=ks < top_k, other=-1) >= 0)
    y = tl.load(y_ptr + (t * top_k + ks)[:, None] * D + offs_d[None, :],
                mask=held[:, None] & (offs_d[None, :] < D), other=0.0)
    wt = tl.load(w_ptr + t * top_k + ks, mask=held, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + offs_d, tl.sum(y.to(tl.float32) * wt[:, None], axis=0).to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


# BLOCK_M -> (BLOCK_N, BLOCK_K, num_warps): the largest tiles whose gate-and-up GEMM
# compiles for sm_90 without register spills (tests/kernels/compile_check.py); not yet
# tuned on a GPU.
_TILES = {16: (64, 32, 4), 32: (64, 64, 8), 64: (64, 64, 8)}


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """Same contract as fused_moe_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run the kernels."""
    if not use_triton(x):
        return fused_moe_ref(x, w13, w2, topk_ids, topk_weights, limit)
    T, D = x.shape
    S, I2, _ = w13.shape
    inter = I2 // 2
    if w13.shape != (S, 2 * inter, D) or w2.shape != (S, D, inter):
        raise ValueError(f"expert weights disagree with x [{T}, {D}]: w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [{T}, K]")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights need a unit stride along their input dimension")
    K = topk_ids.shape[1]
    if T == 0 or K == 0:
        return torch.zeros_like(x)
    x, topk_ids, topk_weights = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    P = T * K
    rows_per_slot = P / S
    block_m = 16 if rows_per_slot <= 16 else 32 if rows_per_slot <= 64 else 64
    bn, bk, warps = _TILES[block_m]
    sorted_pairs, block_slot = moe_align(topk_ids, S, block_m)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(P, inter, dtype=x.dtype, device=x.device)  # [P, I], row per (token, k)
    _fused_moe_kernel[(block_slot.numel(), -(-inter // bn))](
        x, w13, h, sorted_pairs, block_slot,
        inter, D, P, K, inter, float(limit or 0.0),
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0),
        GATE_UP=True, CLAMP=limit is not None, A_PER_TOKEN=True, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=3,
    )
    y = torch.empty(P, D, dtype=x.dtype, device=x.device)  # [P, D], expert outputs
    _fused_moe_kernel[(block_slot.numel(), -(-D // bn))](
        h, w2, y, sorted_pairs, block_slot,
        D, inter, P, K, 0, 0.0, h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0),
        GATE_UP=False, CLAMP=False, A_PER_TOKEN=False, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=3,
    )
    out = torch.empty_like(x)
    block_d = min(1024, next_pow2(D))
    _moe_combine_kernel[(T, -(-D // block_d))](
        y, topk_ids, topk_weights, out, D, K, BLOCK_K=next_pow2(K), BLOCK_D=block_d, num_warps=4,
    )
    return out
