from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.hyper import _hc_merge_kernel, _hc_mix_kernel, hc_merge, hc_merge_ref, hc_mix, hc_mix_ref
from tests.kernels.cases import DEVICE_DTYPES, check, launches, randn

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
F32 = {torch.float32: (1e-5, 1e-5)}  # the gates and the mixing matrix are fp32 whatever the streams


def _inputs(T, N, D, dtype, device, full=True):
    streams = randn(T, N, D, dtype=dtype, device=device, seed=0)
    W = (2 + N) * N if full else N
    fn = randn(W, N * D, dtype=torch.float32, device=device, seed=1, scale=(N * D) ** -0.5)
    mixes = streams.flatten(1).float() @ fn.T
    base = randn(W, dtype=torch.float32, device=device, seed=2, scale=0.1)
    scale = 1 + randn(3 if full else 1, dtype=torch.float32, device=device, seed=3, scale=0.1)
    return mixes, streams, base, scale


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("T,N,D", [(1, 4, 64), (7, 4, 123), (123, 4, 431), (5, 3, 100), (2, 1, 7)])
def test_mix_matches_reference(force_triton, device, dtype, T, N, D):
    force_triton(device)
    args = _inputs(T, N, D, dtype, device)
    with launches(_hc_mix_kernel):
        post, comb, collapsed = hc_mix(*args, 20, 1e-6, 1e-6)
    want_post, want_comb, want_collapsed = hc_mix_ref(*args, 20, 1e-6, 1e-6)
    check(post, want_post, F32)
    check(comb, want_comb, F32)
    check(collapsed, want_collapsed, TOL)
    assert torch.allclose(comb.sum(dim=-2), torch.ones(T, N, device=device), atol=1e-4)  # doubly stochastic


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("T,N,D", [(1, 4, 64), (7, 4, 123), (3, 3, 431)])
def test_head_collapse_matches_reference(force_triton, device, dtype, T, N, D):
    force_triton(device)
    args = _inputs(T, N, D, dtype, device, full=False)
    with launches(_hc_mix_kernel):
        got = hc_mix(*args, 0, 1e-6, 1e-6, full=False)
    check(got, hc_mix_ref(*args, 0, 1e-6, 1e-6, full=False), TOL)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("T,N,D", [(1, 4, 64), (7, 4, 123), (123, 4, 431), (5, 3, 100)])
def test_merge_matches_reference(force_triton, device, dtype, T, N, D):
    force_triton(device)
    streams = randn(T, N, D, dtype=dtype, device=device, seed=4)
    out = randn(T, D, dtype=dtype, device=device, seed=5)
    post = 2 * torch.sigmoid(randn(T, N, dtype=torch.float32, device=device, seed=6))
    comb = torch.softmax(randn(T, N, N, dtype=torch.float32, device=device, seed=7), dim=-1)
    with launches(_hc_merge_kernel):
        got = hc_merge(streams, out, post, comb)
    check(got, hc_merge_ref(streams, out, post, comb), TOL)


def test_the_model_takes_the_kernels_and_agrees_with_its_torch_path(force_triton, monkeypatch):
    """HyperConnection and HyperHead with the kernels forced on, against the same modules
    on the torch path: the kernels' GEMM runs before the RMS scale, the torch path's after."""
    from moemesh.shared.model.v4.hyper import HyperConnection, HyperHead, merge

    T, N, D = 9, 4, 64
    torch.manual_seed(0)
    hc, head = HyperConnection(N, D, 20, 1e-6, 1e-6), HyperHead(N, D, 1e-6, 1e-6)
    with torch.no_grad():
        for p in [*hc.parameters(), *head.parameters()]:
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() < 2 else p.shape[-1] ** -0.5) + (1 if p.dim() == 1 and
                                                                                         p.numel() <= 3 else 0))
    streams, out = torch.randn(T, N, D), torch.randn(T, D)
    monkeypatch.setenv("MOEMESH_KERNELS", "torch")
    post, comb, x = hc(streams)
    want = (post, comb, x, merge(streams, out, post, comb), head(streams))
    force_triton("cpu")
    with launches(_hc_mix_kernel, _hc_merge_kernel):
        post, comb, x = hc(streams)
        got = (post, comb, x, merge(streams, out, post, comb), head(streams))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
