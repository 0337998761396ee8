from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.rmsnorm import _rms_norm_kernel, rms_norm, rms_norm_ref
from tests.kernels.cases import DEVICE_DTYPES, GPU, check, launches, randn

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 123), (123, 431), (2, 3, 64)])
@pytest.mark.parametrize("fused", [False, True])
def test_matches_reference(force_triton, device, dtype, shape, fused):
    force_triton(device)
    x = randn(*shape, dtype=dtype, device=device, seed=0)
    w = randn(shape[-1], dtype=dtype, device=device, seed=1, scale=0.2) + 1
    res = randn(*shape, dtype=dtype, device=device, seed=2) if fused else None
    with launches(_rms_norm_kernel):
        got = rms_norm(x, w, 1e-6, res)
    want = rms_norm_ref(x, w, 1e-6, res)
    if fused:
        check(got[0], want[0], TOL)
        assert torch.equal(got[1], want[1])  # the residual sum rounds exactly like x + residual
    else:
        check(got, want, TOL)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_strided_rows_and_fp32_weight(force_triton, device):
    """A column slice (MLA's latent beside its rope key) and a weight of a wider dtype."""
    force_triton(device)
    x = randn(7, 123 + 9, dtype=torch.float16, device=device, seed=3)[:, :123]
    w = randn(123, dtype=torch.float32, device=device, seed=4)
    with launches(_rms_norm_kernel):
        got = rms_norm(x, w, 1e-5)
    check(got, rms_norm_ref(x, w, 1e-5), TOL)
    assert got.dtype == torch.float32


def test_rejects_a_weight_of_the_wrong_size(force_triton):
    force_triton("cpu")
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.ones(2, 8), torch.ones(7), 1e-6)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (7, 123), (2, 3, 64)])
def test_fp32_weight_matches_reference(force_triton, device, dtype, shape):
    """DeepSeek-V4's norm: an fp32 weight multiplies in fp32, the output is in x's dtype."""
    force_triton(device)
    x = randn(*shape, dtype=dtype, device=device, seed=5)
    w = randn(shape[-1], dtype=torch.float32, device=device, seed=6, scale=0.2) + 1
    with launches(_rms_norm_kernel):
        got = rms_norm(x, w, 1e-6, fp32_weight=True)
    check(got, rms_norm_ref(x, w, 1e-6, fp32_weight=True), TOL)


def test_fp32_weight_rounds_once_as_transformers_v4(monkeypatch):
    """bf16 in, the weight kept in fp32: equal to transformers' DeepseekV4RMSNorm bit for
    bit. The V2/V3 order (round the normalised value, then a bf16 weight) is not."""
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    monkeypatch.setenv("MOEMESH_KERNELS", "torch")
    x = randn(64, 256, dtype=torch.bfloat16, device="cpu", seed=7)
    w = randn(256, dtype=torch.float32, device="cpu", seed=8, scale=0.3) + 1
    hf = v4.DeepseekV4RMSNorm(256, eps=1e-6)
    hf.weight.data = w.clone()
    with torch.no_grad():
        want = hf(x)
    got = rms_norm(x, w, 1e-6, fp32_weight=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert (rms_norm(x, w.to(torch.bfloat16), 1e-6) != want).float().mean() > 0.1
