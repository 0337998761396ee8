"""SwiGLU's activation in one launch: silu(gate) * up, with DeepSeek-V4's clipping
(gate <= limit, |up| <= limit) first when a limit is given. The dense MLP and the shared
experts take it between their projections; in torch it is two to four launches.

Rounding follows the torch path: silu rounds to the input dtype before the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moemesh.shared.kernels._triton import jit, tl
from moemesh.shared.kernels.dispatch import use_triton


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


@jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, cols, stride_g, stride_u, limit, CLAMP: tl.constexpr,
                   BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    r, c = i // cols, i % cols  # gate and up may be column slices of one GEMM's output
    g = tl.load(g_ptr + r * stride_g + c, mask=m, other=0.0)
    u = tl.load(u_ptr + r * stride_u + c, mask=m, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    if CLAMP:
        gf = tl.minimum(gf, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + i, (act * u).to(out_ptr.dtype.element_ty), mask=m)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """Same contract as swiglu_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run the kernel.
    gate and up may have any row stride (halves of a fused gate|up projection)."""
    if not use_triton(gate):
        return swiglu_ref(gate, up, limit)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    g, u = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = g.numel()
    if n:
        block = 1024
        _swiglu_kernel[(-(-n // block),)](g, u, out, n, g.shape[1], g.stride(0), u.stride(0), float(limit or 0.0),
                                          CLAMP=limit is not None, BLOCK=block)
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., C] as [M, C] with unit column stride, copying only when a view cannot do it."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()
