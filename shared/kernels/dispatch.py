"""Which implementation runs: the Triton kernel or the plain-torch reference.

`MOEMESH_KERNELS` chooses, and is read at every call so tests can flip it:
- `auto` (default): CUDA tensors take Triton when it is installed; the rest take torch.
- `torch`: always the reference, for comparison or when a kernel is suspect.
- `triton`: always the kernel; on CPU tensors that only works under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import torch

from moemesh.shared.kernels._triton import interpreting, triton_available

ENV_VAR = "MOEMESH_KERNELS"
MODES = ("auto", "triton", "torch")


def kernel_mode() -> str:
    mode = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r}: choose one of {', '.join(MODES)}")
    return mode


def use_triton(t: torch.Tensor) -> bool:
    """True when the op on tensor `t` should launch its Triton kernel."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "auto":
        return t.is_cuda and triton_available()
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton, but triton is not installed (pip install moemesh[kernels])")
    if not t.is_cuda and not interpreting():
        raise RuntimeError(f"{ENV_VAR}=triton on {t.device} tensors needs TRITON_INTERPRET=1 (the interpreter)")
    return True
