"""DeepSeek-V4's rotary embedding in one launch: interleaved pairs on the trailing R
channels of each head, optionally after a weightless RMS normalisation of the head
(the queries' `unit_rms`), optionally rotated back (the attention output).

Shapes: T = rows, H = heads (or none), d = head width, R = 2 * cos.shape[-1] rotated
channels. Rounding follows the torch path (shared/model/v4/rope.py): the RMS scale is
rounded to x's dtype before it multiplies, the angles are rounded to x's dtype and the
rotation runs in fp32. In torch that is about ten launches per call.
"""

from __future__ import annotations

import torch

from moemesh.shared.kernels._triton import jit, next_pow2, rows_per_program, tl
from moemesh.shared.kernels.dispatch import use_triton


def unit_rms_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
             rms_eps: float | None = None) -> torch.Tensor:
    """x [T, ..., d]; cos/sin [T, R/2] (fp32). Returns x (RMS-normalised first when rms_eps
    is given) with its last R channels rotated by the row's angles."""
    if rms_eps is not None:
        x = unit_rms_ref(x, rms_eps)
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c = cos.to(x.dtype).float().view(shape)
    s = sin.to(x.dtype).float().view(shape)
    if inverse:
        s = -s
    rope = x[..., -2 * half :].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., : -2 * half], out], dim=-1)


@jit
def _v4_rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, rows, H, d, half, stride_cos, eps,
    SIGN: tl.constexpr, RMS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """BLOCK_ROWS heads (of any tokens) per program; a row is one head of one token."""
    r = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    rm = r < rows
    t = r // H
    base = r * d
    cols = tl.arange(0, BLOCK_D)
    m2 = rm[:, None] & (cols < d)[None, :]
    x = tl.load(x_ptr + base[:, None] + cols[None, :], mask=m2, other=0.0)
    if RMS:
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / d + eps)
        scale = rstd.to(x.dtype).to(tl.float32)[:, None]
        y = (xf * scale).to(x.dtype)
    else:
        scale = tl.full([BLOCK_ROWS, 1], 1.0, dtype=tl.float32)
        y = x
    first = d - 2 * half
    tl.store(out_ptr + base[:, None] + cols[None, :], y, mask=m2 & (cols < first)[None, :])
    i = tl.arange(0, BLOCK_R)
    r2 = rm[:, None] & (i < half)[None, :]
    ev = base[:, None] + first + 2 * i[None, :]
    e = tl.load(x_ptr + ev, mask=r2, other=0.0)
    o = tl.load(x_ptr + ev + 1, mask=r2, other=0.0)
    if RMS:  # the normalised value, rounded as the torch path rounds it
        e = (e.to(tl.float32) * scale).to(x.dtype)
        o = (o.to(tl.float32) * scale).to(x.dtype)
    e = e.to(tl.float32)
    o = o.to(tl.float32)
    ang = t[:, None] * stride_cos + i[None, :]
    c = tl.load(cos_ptr + ang, mask=r2, other=0.0).to(x.dtype).to(tl.float32)
    s = tl.load(sin_ptr + ang, mask=r2, other=0.0).to(x.dtype).to(tl.float32) * SIGN
    tl.store(out_ptr + ev, (e * c - o * s).to(out_ptr.dtype.element_ty), mask=r2)
    tl.store(out_ptr + ev + 1, (o * c + e * s).to(out_ptr.dtype.element_ty), mask=r2)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
         rms_eps: float | None = None) -> torch.Tensor:
    """Same contract as rope_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run the kernel."""
    if not use_triton(x):
        return rope_ref(x, cos, sin, inverse, rms_eps)
    T, d, half = x.shape[0], x.shape[-1], cos.shape[-1]
    if cos.shape != sin.shape or cos.shape[0] != T or 2 * half > d:
        raise ValueError(f"rope: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not fit x {tuple(x.shape)}")
    xc = x.contiguous()
    H = xc.numel() // (T * d) if T else 1
    out = torch.empty_like(xc)
    if T:
        c, s = cos.contiguous(), sin.contiguous()
        rows, block_d = T * H, next_pow2(d)
        block_rows = rows_per_program(rows, max(1, min(64, 8192 // block_d)), block_d)
        _v4_rope_kernel[(-(-rows // block_rows),)](
            xc, c, s, out, rows, H, d, half, c.stride(0), rms_eps or 0.0,
            SIGN=-1.0 if inverse else 1.0, RMS=rms_eps is not None, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
            BLOCK_R=next_pow2(half),
        )
    return out
