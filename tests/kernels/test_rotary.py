from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.rotary import _rotary_kernel, rope_cache, rope_cache_ref, rotary, rotary_ref
from tests.kernels.cases import DEVICE_DTYPES, check, launches, randn

TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def _tables(num_pos: int, half: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.arange(num_pos)[:, None] * (10000.0 ** (-torch.arange(half) / half))[None, :]
    return ang.cos().to(device) * 1.1, ang.sin().to(device) * 1.1  # 1.1: a YaRN-like factor


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("T,H,R", [(1, 1, 2), (7, 3, 6), (123, 17, 8), (5, 0, 64)])
@pytest.mark.parametrize("interleave", [True, False])
def test_queries_match_reference(force_triton, device, dtype, T, H, R, interleave):
    """Queries arrive as the rope slice of [T, H, N + R]: a strided view, not a copy."""
    force_triton(device)
    q = randn(T, H, 5 + R, dtype=dtype, device=device, seed=T)[..., 5:]
    cos, sin = _tables(300, R // 2, device)
    pos = torch.randint(0, 300, (T,), generator=torch.Generator().manual_seed(1)).to(device)
    with launches(_rotary_kernel):
        got = rotary(q, cos, sin, pos, interleave)
    check(got, rotary_ref(q, cos, sin, pos, interleave), TOL)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_shared_key_matches_reference(force_triton, device, dtype):
    force_triton(device)
    k = randn(7, 32 + 8, dtype=dtype, device=device, seed=2)[:, 32:]  # [T, R] beside the latent
    cos, sin = _tables(50, 4, device)
    pos = torch.tensor([0, 1, 2, 49, 7, 7, 30], device=device)
    with launches(_rotary_kernel):
        got = rotary(k, cos, sin, pos, True)
    check(got, rotary_ref(k, cos, sin, pos, True), TOL)


def test_rejects_a_table_of_the_wrong_width(force_triton):
    force_triton("cpu")
    cos = torch.ones(4, 3)
    with pytest.raises(ValueError, match="tables"):
        rotary(torch.ones(2, 1, 8), cos, cos, torch.zeros(2, dtype=torch.long), True)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("T,H,C,R", [(1, 1, 8, 2), (7, 3, 24, 6), (40, 17, 64, 8)])
@pytest.mark.parametrize("interleave", [True, False])
def test_rope_and_cache_write_match_reference(force_triton, device, dtype, T, H, C, R, interleave):
    """MLA's rope of q and k and the write of [latent | rotated k] into the cache, as they
    arrive: q the rope slice of [T, H, N + R], latent and k the two parts of one projection."""
    force_triton(device)
    q = randn(T, H, 5 + R, dtype=dtype, device=device, seed=T)[..., 5:]
    kv = randn(T, C + R, dtype=dtype, device=device, seed=T + 1)
    latent, k = (kv[:, :C] * 2).contiguous(), kv[:, C:]
    cos, sin = _tables(300, R // 2, device)
    g = torch.Generator().manual_seed(2)
    pos = torch.randint(0, 300, (T,), generator=g).to(device)
    slots = torch.randperm(3 * T, generator=g)[:T].to(device)
    cache = randn(3 * T, C + R, dtype=dtype, device=device, seed=5)
    want_cache = cache.clone()
    want = rope_cache_ref(q, latent, k, cos, sin, pos, slots, want_cache, interleave)
    with launches(_rotary_kernel):
        got = rope_cache(q, latent, k, cos, sin, pos, slots, cache, interleave)
    check(got, want, TOL)
    check(cache, want_cache, TOL)
