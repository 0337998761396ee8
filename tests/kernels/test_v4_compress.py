from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.v4_compress import _compress_kernel, compress, compress_ref
from tests.kernels.cases import DEVICE_DTYPES, check, launches, randn

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def _case(T, npre, G, rate, width, half, overlap, dtype, device, bias_f32=True, seed=0):
    """T batch rows and npre earlier positions (in a ring of 3 x 16 slots), G groups
    over them, some slots before position 0."""
    series = 2 if overlap else 1
    P = 2 * series * width
    span = series * rate
    g = torch.Generator().manual_seed(seed)
    proj = randn(T, P, dtype=dtype, device=device, seed=seed)
    ring = randn(3, 16, P, dtype=dtype, device=device, seed=seed + 1)
    pre_ring = torch.randint(0, 3, (npre,), generator=g).to(device)
    pre_slot = torch.randint(0, 16, (npre,), generator=g).to(device)
    idx = torch.randint(0, T + npre, (G, span), generator=g)
    idx[0, : span // 2] = -1  # the first group starts at position 0: its earlier slots are empty
    pos = torch.randint(0, 5000, (G,), generator=g)
    blk = torch.randperm(G + 2, generator=g)[:G]
    slot = torch.randint(0, 4, (G,), generator=g)
    bias = randn(rate, series * width, dtype=torch.float32 if bias_f32 else dtype, device=device, seed=seed + 2)
    w = 1 + 0.1 * randn(width, dtype=dtype, device=device, seed=seed + 3)
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    args = (proj, ring, pre_ring, pre_slot, idx.to(device), pos.to(device), blk.to(device), slot.to(device),
            bias, w, 1e-6, inv.to(device), 1.1, rate, overlap)
    store = torch.zeros(G + 2, 4, width, dtype=dtype, device=device)
    return args, store


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("T,npre,G,rate,width,half,overlap", [
    (5, 3, 2, 4, 32, 8, True),  # CSA: 2m slots over two series
    (9, 30, 3, 16, 64, 16, False),  # HCA
    (1, 7, 1, 4, 16, 8, True),  # the indexer's narrow keys
    (4, 6, 2, 4, 24, 4, True),  # a width that is no power of two
])
def test_matches_reference(force_triton, device, dtype, T, npre, G, rate, width, half, overlap):
    force_triton(device)
    args, store = _case(T, npre, G, rate, width, half, overlap, dtype, device)
    want = store.clone()
    compress_ref(*args, want)
    with launches(_compress_kernel):
        compress(*args, store)
    check(store, want, TOL)
    assert store.abs().sum() > 0


def test_bias_in_the_model_dtype(force_triton):
    force_triton("cpu")
    args, store = _case(6, 4, 2, 4, 32, 8, True, torch.float16, "cpu", bias_f32=False, seed=4)
    want = store.clone()
    compress_ref(*args, want)
    with launches(_compress_kernel):
        compress(*args, store)
    check(store, want, TOL)


def test_a_long_span_in_chunks(force_triton, monkeypatch):
    """A span longer than a tile (V4-Flash's HCA pools 128 slots) takes several passes."""
    force_triton("cpu")
    from moemesh.shared.kernels import v4_compress

    monkeypatch.setattr(v4_compress, "interpreting", lambda: False)  # the compiled tiles: 4k elements
    args, store = _case(40, 100, 2, 128, 64, 16, False, torch.float32, "cpu", seed=5)
    assert v4_compress.compress_tiles(128, 64) == (64, 64)
    want = store.clone()
    compress_ref(*args, want)
    with launches(_compress_kernel):
        compress(*args, store)
    check(store, want, TOL)


def test_rejects_a_bias_of_another_shape(force_triton):
    force_triton("cpu")
    args, store = _case(5, 3, 2, 4, 32, 8, True, torch.float32, "cpu")
    bad = list(args)
    bad[8] = torch.zeros(4, 32)
    with pytest.raises(ValueError, match="do not fit"):
        compress(*bad, store)
