"""DeepSeek-V4's compressor, from the window's projections to the cache entry, in one launch.

For each group completing in the batch (shared/model/v4/compressor.py): gather its span
of projections (the batch's own rows, or earlier positions where they lie in the ring),
add the per-slot position bias to the gates, take a softmax over the slots per channel
(empty slots before position 0 weigh nothing), pool the kv projections with it, RMS
normalise with the norm's weight, rotate the trailing rope channels at the group's
first position, and write the entry into its cache block and slot.

Shapes: T = batch rows, P = projection width (kv | gate, each `series` x W), W = entry
width, m = rate, span = m (2m with CSA's overlap), G = groups.
"""

from __future__ import annotations

import torch

from moemesh.shared.kernels._triton import interpreting, jit, next_pow2, tl
from moemesh.shared.kernels.dispatch import use_triton
from moemesh.shared.kernels.rmsnorm import rms_norm_ref
from moemesh.shared.kernels.v4_rope import rope_ref


def pool_ref(ctx: torch.Tensor, idx: torch.Tensor, bias: torch.Tensor, rate: int, width: int,
             overlap: bool) -> torch.Tensor:
    """ctx [N, P] projections; idx [G, span] ctx rows (-1: before position 0); bias
    [m, series * W]. Returns the pooled entries [G, W], before the norm."""
    m, w = rate, width
    kv, gate = ctx[idx.clamp(min=0)].split(ctx.shape[-1] // 2, dim=-1)  # [G, span, series*w]
    if overlap:  # slots [0, m): the previous group's Ca; [m, 2m): this group's Cb
        kv = torch.cat([kv[:, :m, :w], kv[:, m:, w:]], dim=1)
        gate = torch.cat([gate[:, :m, :w] + bias[:, :w], gate[:, m:, w:] + bias[:, w:]], dim=1)
    else:
        gate = gate + bias
    empty = (idx < 0).unsqueeze(-1)
    gate = gate.masked_fill(empty, float("-inf"))
    kv = kv.masked_fill(empty, 0.0)
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def angles_ref(pos: torch.Tensor, inv_freq: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [G, R/2] in fp32, as shared/model/v4/rope.Rope.angles computes them."""
    freqs = pos[:, None].float() * inv_freq[None, :].to(pos.device)
    return freqs.cos() * factor, freqs.sin() * factor


def compress_ref(proj: torch.Tensor, ring: torch.Tensor, pre_ring: torch.Tensor, pre_slot: torch.Tensor,
                 idx: torch.Tensor, pos: torch.Tensor, blk: torch.Tensor, slot: torch.Tensor,
                 bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                 factor: float, rate: int, overlap: bool, store: torch.Tensor) -> None:
    """proj [T, P]: the batch's projections; ring [rings, s, P] the ring region that holds
    earlier ones, the pre positions' at (pre_ring, pre_slot); idx/pos/blk/slot: the
    groups (v4/batch.Groups). Writes the entries into store[blk, slot] ([blocks, per_block, W])."""
    ctx = torch.cat([proj, ring[pre_ring, pre_slot].to(proj.dtype)])
    pooled = pool_ref(ctx, idx, bias, rate, norm_weight.numel(), overlap)
    cos, sin = angles_ref(pos, inv_freq, factor)
    store[blk, slot] = rope_ref(rms_norm_ref(pooled, norm_weight, eps, fp32_weight=True), cos, sin).to(store.dtype)


@jit
def _compress_kernel(
    proj_ptr, ring_ptr, pre_ring_ptr, pre_slot_ptr, idx_ptr, pos_ptr, blk_ptr, slot_ptr, bias_ptr, w_ptr,
    inv_ptr, store_ptr,
    T, W, SW, m, span, half, eps, factor,
    stride_proj, stride_rr, stride_rs, stride_sb, stride_ss,
    OVERLAP: tl.constexpr, BIAS_F32: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """One group per program, its span BLOCK_S slots at a time over all BLOCK_W channels:
    a first pass for each channel's softmax maximum and sum, a second that pools with the
    weights rounded as the reference rounds them."""
    g = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_W)
    cmask = c < W
    dtype = proj_ptr.dtype.element_ty
    mx = tl.full([BLOCK_W], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_W], dtype=tl.float32)
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for second in tl.static_range(2):
        for s0 in range(0, span, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            smask = s < span
            ix = tl.load(idx_ptr + g * span + s, mask=smask, other=-1).to(tl.int64)
            valid = ix >= 0
            mine = valid & (ix < T)  # a row of this batch
            pre = valid & (ix >= T)  # an earlier position, in the ring
            j = tl.where(pre, ix - T, 0)
            rr = tl.load(pre_ring_ptr + j, mask=pre, other=0).to(tl.int64)
            rs = tl.load(pre_slot_ptr + j, mask=pre, other=0).to(tl.int64)
            if OVERLAP:  # slot s < m reads series a (channels [0, W)), s >= m series b ([W, 2W))
                off = tl.where(s >= m, W, 0)
            else:
                off = s * 0
            chan = off[:, None] + c[None, :]
            own = mine[:, None] & cmask[None, :]
            old = pre[:, None] & cmask[None, :]
            row = tl.where(mine, ix, 0)[:, None] * stride_proj + chan
            ring_row = (rr * stride_rr + rs * stride_rs)[:, None] + chan
            gate = (tl.load(proj_ptr + row + SW, mask=own, other=0.0).to(tl.float32)
                    + tl.load(ring_ptr + ring_row + SW, mask=old, other=0.0).to(dtype).to(tl.float32))
            b = tl.load(bias_ptr + (s % m)[:, None] * SW + chan, mask=smask[:, None] & cmask[None, :], other=0.0)
            gate = gate + b.to(tl.float32)
            if not BIAS_F32:  # the sum rounds to the gate's dtype, as torch's does
                gate = gate.to(dtype).to(tl.float32)
            live = valid[:, None] & cmask[None, :]
            gate = tl.where(live, gate, float("-inf"))
            if second == 0:
                new = tl.maximum(mx, tl.max(gate, axis=0))
                ref = tl.where(new == float("-inf"), 0.0, new)  # no live slot yet (or a padding channel)
                total = total * tl.exp(mx - ref) + tl.sum(tl.exp(gate - ref[None, :]), axis=0)
                mx = new
            else:
                kv = (tl.load(proj_ptr + row, mask=own, other=0.0).to(tl.float32)
                      + tl.load(ring_ptr + ring_row, mask=old, other=0.0).to(dtype).to(tl.float32))
                ref = tl.where(mx == float("-inf"), 0.0, mx)
                norm = tl.where(total > 0, total, 1.0)  # padding channels have no live slot
                p = (tl.exp(gate - ref[None, :]) / norm[None, :]).to(dtype).to(tl.float32)
                acc += tl.sum(tl.where(live, (kv * p).to(dtype).to(tl.float32), 0.0), axis=0)
    xf = acc.to(dtype).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.where(cmask, xf * xf, 0.0), axis=0) / W + eps)
    wt = tl.load(w_ptr + c, mask=cmask, other=0.0)
    y = (wt.to(tl.float32) * (xf * rstd)).to(dtype).to(tl.float32)  # V4's norm: the weight in fp32, one rounding
    # The rotation pairs channel 2i with 2i + 1; channels before the rope part pass as they are.
    ev, od = tl.split(tl.reshape(y, [BLOCK_W // 2, 2]))
    i = tl.arange(0, BLOCK_W // 2)
    ri = i - (W // 2 - half)
    rot = (ri >= 0) & (ri < half)
    ang = tl.load(pos_ptr + g).to(tl.float32) * tl.load(inv_ptr + tl.where(rot, ri, 0), mask=rot, other=0.0)
    cs = tl.where(rot, (tl.cos(ang) * factor).to(dtype).to(tl.float32), 1.0)
    sn = tl.where(rot, (tl.sin(ang) * factor).to(dtype).to(tl.float32), 0.0)
    out = tl.reshape(tl.join(ev * cs - od * sn, od * cs + ev * sn), [BLOCK_W]).to(dtype)
    dst = tl.load(blk_ptr + g).to(tl.int64) * stride_sb + tl.load(slot_ptr + g).to(tl.int64) * stride_ss
    tl.store(store_ptr + dst + c, out.to(store_ptr.dtype.element_ty), mask=cmask)


def compress_tiles(span: int, width: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_W): all channels at once (the norm needs them), the span in chunks
    of tiles up to 4k elements, which compile for sm_90 without spills at W = 512
    (tests/kernels/compile_check.py); under the interpreter the whole span, as its cost
    is per loop step."""
    block_w = max(2, next_pow2(width))
    cap = 1 << 15 if interpreting() else 4096
    return max(1, min(next_pow2(span), cap // block_w)), block_w


def compress(proj: torch.Tensor, ring: torch.Tensor, pre_ring: torch.Tensor, pre_slot: torch.Tensor,
             idx: torch.Tensor, pos: torch.Tensor, blk: torch.Tensor, slot: torch.Tensor,
             bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
             factor: float, rate: int, overlap: bool, store: torch.Tensor) -> None:
    """Same contract as compress_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run the kernel."""
    W = norm_weight.numel()
    series = 2 if overlap else 1
    G, span = idx.shape
    half = inv_freq.numel()
    if proj.shape[-1] != 2 * series * W or bias.shape != (rate, series * W) or span != series * rate \
            or 2 * half > W or store.shape[-1] != W:
        raise ValueError(f"compress: proj {tuple(proj.shape)}, bias {tuple(bias.shape)}, idx {tuple(idx.shape)}, "
                         f"store {tuple(store.shape)} do not fit W={W}, rate={rate}, overlap={overlap}")
    if not use_triton(proj) or norm_weight.dtype not in (torch.float32, proj.dtype) \
            or bias.dtype not in (torch.float32, proj.dtype):
        return compress_ref(proj, ring, pre_ring, pre_slot, idx, pos, blk, slot, bias, norm_weight, eps, inv_freq,
                            factor, rate, overlap, store)
    if not G:
        return None
    if proj.stride(-1) != 1 or ring.stride(-1) != 1 or store.stride(-1) != 1:
        raise ValueError("compress: proj, ring and store need a unit stride along their channels")
    block_s, block_w = compress_tiles(span, W)
    _compress_kernel[(G,)](
        proj, ring, pre_ring.contiguous(), pre_slot.contiguous(), idx.contiguous(), pos, blk, slot,
        bias.contiguous(), norm_weight, inv_freq.to(torch.float32).contiguous(), store,
        proj.shape[0], W, series * W, rate, span, half, eps, float(factor),
        proj.stride(0), ring.stride(0), ring.stride(1), store.stride(0), store.stride(1),
        OVERLAP=overlap, BIAS_F32=bias.dtype == torch.float32, BLOCK_S=block_s, BLOCK_W=block_w, num_warps=4,
    )
    return None
