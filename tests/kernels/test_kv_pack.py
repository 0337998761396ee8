from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.kv_pack import _kv_pack_kernel, kv_gather, kv_gather_ref, kv_scatter, kv_scatter_ref
from tests.kernels.cases import DEVICE_DTYPES, GPU, launches, randn

# Packing moves bytes; any difference at all is a bug, so every comparison is exact.
SHAPES = [(1, 3, 1, 1), (2, 9, 7, 5), (3, 40, 16, 123)]  # [L, NB, bs, D]


def _ids(n: int, num_blocks: int, device: str) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(n))[:n].to(device)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", [1, 3, 7])
def test_gather_then_scatter_round_trips(force_triton, device, dtype, shape, n):
    force_triton(device)
    n = min(n, shape[1])
    cache = randn(*shape, dtype=dtype, device=device, seed=0)
    ids = _ids(n, shape[1], device)
    with launches(_kv_pack_kernel):
        packed = kv_gather(cache, ids)
    assert torch.equal(packed, kv_gather_ref(cache, ids))

    fresh = torch.zeros_like(cache)
    expect = torch.zeros_like(cache)
    with launches(_kv_pack_kernel):
        kv_scatter(fresh, ids, packed)
    kv_scatter_ref(expect, ids, packed)
    assert torch.equal(fresh, expect)
    assert torch.equal(fresh[:, ids], cache[:, ids])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_gather_into_a_buffer_and_scatter_with_conversion(force_triton, device):
    force_triton(device)
    cache = randn(2, 11, 4, 24, dtype=torch.float16, device=device, seed=1)
    ids = torch.tensor([10, 0, 5], device=device)
    out = torch.empty(2, 3, 4, 24, dtype=torch.float16, device=device)
    with launches(_kv_pack_kernel):
        got = kv_gather(cache, ids, out)
    assert got is out and torch.equal(out, kv_gather_ref(cache, ids))

    buf = randn(2, 3, 4, 24, dtype=torch.float32, device=device, seed=2)  # a peer in fp32
    a, b = cache.clone(), cache.clone()
    with launches(_kv_pack_kernel):
        kv_scatter(a, ids, buf)
    kv_scatter_ref(b, ids, buf)
    assert torch.equal(a, b)


def test_empty_and_misshapen_requests(force_triton):
    force_triton("cpu")
    cache = torch.randn(2, 5, 4, 8)
    none = torch.zeros(0, dtype=torch.long)
    assert kv_gather(cache, none).shape == (2, 0, 4, 8)
    kv_scatter(cache, none, torch.zeros(2, 0, 4, 8))
    with pytest.raises(ValueError, match="expected"):
        kv_scatter(cache, torch.tensor([1]), torch.zeros(2, 2, 4, 8))
