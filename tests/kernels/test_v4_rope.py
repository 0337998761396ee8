from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.v4_rope import _v4_rope_kernel, rope, rope_ref
from tests.kernels.cases import DEVICE_DTYPES, check, launches, randn

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("shape,half", [((1, 32), 4), ((7, 4, 32), 4), ((123, 3, 64), 16), ((5, 431), 7),
                                        ((2, 1, 8), 4)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("rms", [None, 1e-6])
def test_matches_reference(force_triton, device, dtype, shape, half, inverse, rms):
    force_triton(device)
    x = randn(*shape, dtype=dtype, device=device, seed=0)
    ang = randn(shape[0], half, dtype=torch.float32, device=device, seed=1, scale=3.0)
    cos, sin = ang.cos() * 1.1, ang.sin() * 1.1  # a YaRN attention factor
    with launches(_v4_rope_kernel):
        got = rope(x, cos, sin, inverse, rms)
    check(got, rope_ref(x, cos, sin, inverse, rms), TOL)


def test_inverse_undoes_the_rotation(force_triton):
    force_triton("cpu")
    x = randn(9, 2, 16, dtype=torch.float32, device="cpu", seed=2)
    ang = randn(9, 4, dtype=torch.float32, device="cpu", seed=3)
    back = rope(rope(x, ang.cos(), ang.sin()), ang.cos(), ang.sin(), inverse=True)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


def test_rejects_angles_for_other_rows(force_triton):
    force_triton("cpu")
    with pytest.raises(ValueError, match="do not fit"):
        rope(torch.ones(3, 8), torch.ones(2, 2), torch.ones(2, 2))
