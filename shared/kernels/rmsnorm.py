"""RMSNorm, optionally fused with the residual add that precedes it.

M = rows (tokens), D = hidden size. The fused form takes the block output `x` and the
running `residual`, and returns (rmsnorm(x + residual), x + residual): one read of
each input and one write of each output instead of a separate add.

Two orders of rounding, as the reference models norm: V2/V3 (and transformers' models of
them) round the normalised value to x's dtype, then multiply by a weight held in the
model's dtype; DeepSeek-V4 holds the weight in fp32 and multiplies in fp32, rounding
once to x's dtype (`fp32_weight`).
"""

from __future__ import annotations

import torch

from moemesh.shared.kernels._triton import jit, next_pow2, rows_per_program, tl
from moemesh.shared.kernels.dispatch import use_triton


def rms_norm_ref(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., D]
    fp32_weight: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    # Normalise in fp32; round where the reference model rounds (the module docstring):
    # the order matters for bf16 agreement.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight.float() * xf).to(dtype) if fp32_weight else weight * xf.to(dtype)
    return out if residual is None else (out, x)


@jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    M, D, stride_x, stride_res, stride_out, stride_res_out, eps,
    HAS_RESIDUAL: tl.constexpr, FP32_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """BLOCK_M rows per program (one on a GPU: a row fills the tile)."""
    row = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (row < M)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        x = x + r  # in the input dtype, as the unfused add rounds
        tl.store(res_out_ptr + row[:, None] * stride_res_out + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
    y = xf * rstd[:, None]
    if not FP32_WEIGHT:  # the normalised value rounds before the weight, as the unfused ops do
        y = y.to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + row[:, None] * stride_out + cols[None, :], (w[None, :] * y).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    fp32_weight: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rms_norm_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run the kernel."""
    if not use_triton(x):
        return rms_norm_ref(x, weight, eps, residual, fp32_weight)
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({D},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    x2 = _rows(x)
    res2 = _rows(residual) if residual is not None else x2
    M = x2.shape[0]
    out_dtype = x.dtype if fp32_weight else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if M:
        block_d = next_pow2(D)
        block_m = rows_per_program(M, 1, block_d)
        _rms_norm_kernel[(-(-M // block_m),)](
            x2, res2, weight.contiguous(), out, res_out,
            M, D, x2.stride(0), res2.stride(0), D, res_out.stride(0), eps,
            HAS_RESIDUAL=residual is not None, FP32_WEIGHT=fp32_weight, BLOCK_M=block_m, BLOCK_D=block_d,
            num_warps=min(16, max(1, block_d // 256)),
        )
    return out if residual is None else (out, res_out.view(x.shape))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] as [M, D] with unit column stride, copying only when a view cannot do it."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
