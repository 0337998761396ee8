"""Rotary embedding of the rope part of MLA's queries and keys.

T = tokens, H = heads (1 for the shared rope key), R = rope dims, P = table positions.
Pairs are (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + R/2]); either way the
output is [rotated firsts | rotated seconds], the layout the latent cache keeps.
"""

from __future__ import annotations

import torch

from moemesh.shared.kernels._triton import jit, next_pow2, tl
from moemesh.shared.kernels.dispatch import use_triton


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x: [..., R]; cos, sin: broadcastable to [..., R/2], already in x's dtype."""
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rotary_ref(
    x: torch.Tensor,  # [T, R] or [T, H, R]
    cos_table: torch.Tensor,  # [P, R/2] fp32
    sin_table: torch.Tensor,  # [P, R/2] fp32
    positions: torch.Tensor,  # [T]
    interleave: bool,
) -> torch.Tensor:
    cos = cos_table[positions].to(x.dtype)
    sin = sin_table[positions].to(x.dtype)
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return apply_rotary(x, cos, sin, interleave)


@jit
def _rotary_kernel(
    q_ptr, k_ptr, lat_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, out_ptr, cache_ptr,
    H, HALF, C, head_blocks, stride_qt, stride_qh, stride_kt, stride_lt, stride_ct, stride_ot, stride_oh,
    stride_cache,
    INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Programs (t, 0 .. head_blocks-1) rotate q's heads into out; with a cache (MLA,
    rope_cache), program (t, head_blocks) rotates k and writes the token's cache row
    [latent | rotated k]. rotary() launches the heads' programs alone."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)
    cm = cols < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_ct + cols, mask=cm, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_ct + cols, mask=cm, other=0.0)
    if j < head_blocks:
        heads = j * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < H) & cm[None, :]
        row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
        dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    else:  # the same [BLOCK_H, BLOCK_HALF] tiles, k in the first row
        heads = tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < 1) & cm[None, :]
        row = k_ptr + t * stride_kt + heads[:, None] * 0
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = cache_ptr + slot * stride_cache + C + heads[:, None] * 0 + cols[None, :]
        c = tl.arange(0, BLOCK_C)
        lat = tl.load(lat_ptr + t * stride_lt + c, mask=c < C, other=0.0)
        tl.store(cache_ptr + slot * stride_cache + c, lat.to(cache_ptr.dtype.element_ty), mask=c < C)
    if INTERLEAVE:
        a = tl.load(row + 2 * cols[None, :], mask=mask, other=0.0)
        b = tl.load(row + 2 * cols[None, :] + 1, mask=mask, other=0.0)
    else:
        a = tl.load(row + cols[None, :], mask=mask, other=0.0)
        b = tl.load(row + HALF + cols[None, :], mask=mask, other=0.0)
    # The tables are rounded to x's dtype first, as the reference rounds them.
    cf = cos.to(a.dtype).to(tl.float32)[None, :]
    sf = sin.to(a.dtype).to(tl.float32)[None, :]
    af, bf = a.to(tl.float32), b.to(tl.float32)
    tl.store(dst, (af * cf - bf * sf).to(a.dtype), mask=mask)
    tl.store(dst + HALF, (bf * cf + af * sf).to(a.dtype), mask=mask)


def rotary(
    x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Same contract as rotary_ref; returns a new contiguous tensor shaped like x."""
    if not use_triton(x):
        return rotary_ref(x, cos_table, sin_table, positions, interleave)
    if x.dim() not in (2, 3) or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, R] or [T, H, R] with R even, got {tuple(x.shape)}")
    T, R = x.shape[0], x.shape[-1]
    half = R // 2
    if cos_table.shape != sin_table.shape or cos_table.dim() != 2 or cos_table.shape[1] != half:
        raise ValueError(f"cos/sin tables must both be [P, {half}], "
                         f"got {tuple(cos_table.shape)}, {tuple(sin_table.shape)}")
    if positions.shape != (T,):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected ({T},)")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    cos_t, sin_t = cos_table.contiguous(), sin_table.contiguous()
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    H = x3.shape[1]
    if T:
        block_h = min(16, next_pow2(H))
        head_blocks = -(-H // block_h)
        # The heads' programs only: the cache row's program (and its arguments) is not launched.
        _rotary_kernel[(T, head_blocks)](
            x3, x3, x3, cos_t, sin_t, positions, positions, out, out,
            H, half, 0, head_blocks, x3.stride(0), x3.stride(1), 0, 0, cos_t.stride(0), out.stride(0),
            out.stride(1), 0,
            INTERLEAVE=interleave, BLOCK_H=block_h, BLOCK_HALF=next_pow2(half), BLOCK_C=1, num_warps=1,
        )
    return out.view(x.shape)


def rope_cache_ref(q: torch.Tensor, latent: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                   sin_table: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                   interleave: bool) -> torch.Tensor:
    """MLA's rope and cache write: q [T, H, R] and k [T, R] rotated; [latent | rotated k]
    written into cache rows `slots` (cache [rows, C + R]). Returns the rotated q."""
    q_rot = rotary_ref(q, cos_table, sin_table, positions, interleave)
    k_rot = rotary_ref(k, cos_table, sin_table, positions, interleave)
    cache.index_copy_(0, slots, torch.cat([latent, k_rot], dim=-1).to(cache.dtype))
    return q_rot


def rope_cache(q: torch.Tensor, latent: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
               sin_table: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
               interleave: bool) -> torch.Tensor:
    """Same contract as rope_cache_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run one kernel."""
    if not use_triton(q) or not q.dtype == k.dtype == cache.dtype:
        return rope_cache_ref(q, latent, k, cos_table, sin_table, positions, slots, cache, interleave)
    T, H, R = q.shape
    C = latent.shape[-1]
    half = R // 2
    if R % 2 or k.shape != (T, R) or latent.shape != (T, C) or cache.shape[-1] != C + R \
            or cos_table.shape != sin_table.shape or cos_table.shape[-1] != half or positions.shape != (T,) \
            or slots.shape != (T,):
        raise ValueError(f"rope_cache: q {tuple(q.shape)}, latent {tuple(latent.shape)}, k {tuple(k.shape)}, "
                         f"cache {tuple(cache.shape)}, tables {tuple(cos_table.shape)} do not fit")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or latent.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("rope_cache: q, k, latent and the cache need a unit stride along their last dimension")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T:
        cos_t, sin_t = cos_table.contiguous(), sin_table.contiguous()
        block_h = min(16, next_pow2(H))
        head_blocks = -(-H // block_h)
        _rotary_kernel[(T, head_blocks + 1)](
            q, k, latent, cos_t, sin_t, positions, slots, out, cache,
            H, half, C, head_blocks, q.stride(0), q.stride(1), k.stride(0), latent.stride(0), cos_t.stride(0),
            out.stride(0), out.stride(1), cache.stride(0),
            INTERLEAVE=interleave, BLOCK_H=block_h, BLOCK_HALF=next_pow2(half), BLOCK_C=next_pow2(C), num_warps=1,
        )
    return out
