from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.swiglu import _swiglu_kernel, swiglu, swiglu_ref
from tests.kernels.cases import DEVICE_DTYPES, check, launches, randn

TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 123), (123, 431), (3, 2, 5)])
@pytest.mark.parametrize("limit", [None, 0.7])
def test_matches_reference(force_triton, device, dtype, shape, limit):
    force_triton(device)
    gate = randn(*shape, dtype=dtype, device=device, seed=0, scale=2.0)
    up = randn(*shape, dtype=dtype, device=device, seed=1, scale=2.0)
    with launches(_swiglu_kernel):
        got = swiglu(gate, up, limit)
    check(got, swiglu_ref(gate, up, limit), TOL)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 96), (33, 257)])
def test_gate_and_up_as_the_halves_of_one_projection(force_triton, device, dtype, rows, cols):
    """A fused gate|up GEMM's output: two column slices with its row stride, read in place."""
    force_triton(device)
    both = randn(rows, 2 * cols, dtype=dtype, device=device, seed=2, scale=2.0)
    gate, up = both[:, :cols], both[:, cols:]
    with launches(_swiglu_kernel):
        got = swiglu(gate, up, 0.7)
    assert got.is_contiguous()
    check(got, swiglu_ref(gate, up, 0.7), TOL)
