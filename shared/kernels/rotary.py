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
    x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr,
    H, HALF, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
    INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < H) & (cols[None, :] < HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # The tables are rounded to x's dtype first, as the reference rounds them.
    cos = tl.load(cos_ptr + pos * stride_ct + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_ct + cols, mask=cols < HALF, other=0.0)
    row = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    if INTERLEAVE:
        a = tl.load(row + 2 * cols[None, :], mask=mask, other=0.0)
        b = tl.load(row + 2 * cols[None, :] + 1, mask=mask, other=0.0)
    else:
        a = tl.load(row + cols[None, :], mask=mask, other=0.0)
        b = tl.load(row + HALF + cols[None, :], mask=mask, other=0.0)
    cos = cos.to(a.dtype).to(tl.float32)[None, :]
    sin = sin.to(a.dtype).to(tl.float32)[None, :]
    af, bf = a.to(tl.float32), b.to(tl.float32)
    dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    tl.store(dst, (af * cos - bf * sin).to(a.dtype), mask=mask)
    tl.store(dst + HALF, (bf * cos + af * sin).to(a.dtype), mask=mask)


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
        grid = (T, -(-H // block_h))
        _rotary_kernel[grid](
            x3, cos_t, sin_t, positions, out,
            H, half, x3.stride(0), x3.stride(1), cos_t.stride(0), out.stride(0), out.stride(1),
            INTERLEAVE=interleave, BLOCK_H=block_h, BLOCK_HALF=next_pow2(half), num_warps=1,
        )
    return out.view(x.shape)
