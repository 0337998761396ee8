"""What every kernel test shares: the device/dtype grid and the comparison helpers.

bf16 runs only on CUDA: the interpreter computes bf16 wrongly, so a CPU bf16 case would
test the interpreter rather than the kernel.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from moemesh.shared.kernels._triton import LazyKernel

GPU = (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))

DEVICE_DTYPES = [
    pytest.param("cpu", torch.float32, id="cpu-fp32"),
    pytest.param("cpu", torch.float16, id="cpu-fp16"),
    pytest.param("cuda", torch.float32, id="cuda-fp32", marks=GPU),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=GPU),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=GPU),
]


def randn(*shape: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)


def check(got: torch.Tensor, want: torch.Tensor, tol: dict[torch.dtype, tuple[float, float]]) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    atol, rtol = tol[want.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@contextlib.contextmanager
def launches(*kernels: LazyKernel) -> Iterator[None]:
    """Fails unless every kernel launched inside the block, so a test whose dispatch
    quietly fell back to the reference cannot pass by comparing it with itself."""
    before = [k.num_launches for k in kernels]
    yield
    idle = [k.__name__ for k, b in zip(kernels, before) if k.num_launches == b]
    assert not idle, f"kernels never launched: {idle}"
