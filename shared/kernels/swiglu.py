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
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    g = tl.load(g_ptr + i, mask=m, other=0.0)
    u = tl.load(u_ptr + i, mask=m, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    if CLAMP:
        gf = tl.minimum(gf, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + i, (act * u).to(out_ptr.dtype.element_ty), mask=m)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """Same contract as swiglu_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run the kernel."""
    if not use_triton(gate):
        return swiglu_ref(gate, up, limit)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        block = 1024
        _swiglu_kernel[(-(-n // block),)](g, u, out, n, float(limit or 0.0), CLAMP=limit is not None, BLOCK=block)
    return out
