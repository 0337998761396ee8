from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.mla_decode import _mla_decode_kernel, _mla_decode_reduce_kernel, mla_decode, mla_decode_ref
from tests.kernels.cases import DEVICE_DTYPES, GPU, check, launches, randn

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (4e-2, 4e-2)}


def _case(B, H, N, R, C, V, block_size, lens, dtype, device, cache_dtype=None, seed=0):
    """Random inputs with each sequence's blocks scattered over a shared pool."""
    max_blocks = -(-max(lens) // block_size)
    pool = B * max_blocks + 3
    g = torch.Generator().manual_seed(seed)
    block_tables = torch.randperm(pool, generator=g)[: B * max_blocks].view(B, max_blocks).to(device)
    kv_cache = randn(pool, block_size, C + R, dtype=cache_dtype or dtype, device=device, seed=seed + 1)
    return (
        randn(B, H, N, dtype=dtype, device=device, seed=seed + 2),
        randn(B, H, R, dtype=dtype, device=device, seed=seed + 3),
        kv_cache,
        block_tables,
        torch.tensor(lens, device=device),
        randn(H, N, C, dtype=dtype, device=device, seed=seed + 4, scale=N**-0.5),
        randn(H, V, C, dtype=dtype, device=device, seed=seed + 5, scale=C**-0.5),
        (N + R) ** -0.5,
    )


KERNELS = (_mla_decode_kernel, _mla_decode_reduce_kernel)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize(
    "B,H,block_size,lens",
    [(1, 1, 16, [1]), (3, 5, 4, [1, 17, 24]), (7, 17, 16, [123, 1, 7, 64, 65, 33, 2]), (2, 4, 1, [9, 3])],
)
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_matches_reference(force_triton, device, dtype, B, H, block_size, lens, num_splits):
    force_triton(device)
    args = _case(B, H, 8, 4, 12, 6, block_size, lens, dtype, device)
    with launches(*KERNELS):
        got = mla_decode(*args, num_splits=num_splits)
    check(got, mla_decode_ref(*args), TOL)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_real_head_dims_and_a_cache_of_another_dtype(force_triton, device, dtype):
    """DeepSeek's own widths (C=512, R=64, N=V=128), the cache kept in fp32."""
    force_triton(device)
    args = _case(2, 2, 128, 64, 512, 128, 16, [5, 40], dtype, device, cache_dtype=torch.float32, seed=7)
    with launches(*KERNELS):
        got = mla_decode(*args)
    check(got, mla_decode_ref(*args), TOL)


def test_no_sequences(force_triton):
    force_triton("cpu")
    args = _case(1, 2, 8, 4, 12, 6, 4, [3], torch.float32, "cpu")
    empty = (args[0][:0], args[1][:0], args[2], args[3][:0], args[4][:0], *args[5:])
    assert mla_decode(*empty).shape == (0, 2, 6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_bf16_scores_are_not_rounded(force_triton, monkeypatch, device):
    """Two keys whose scores, 192 and 193.5, are 1.5 apart; bf16 spacing there is 1, so a
    score rounded to bf16 reads 194 and moves a fifth of the weight on the second key's
    value (8 -> 7.05 instead of 6.54). The reference (CPU) and the kernel (CUDA) keep the
    scores in fp32, as transformers' attention does."""
    if device == "cpu":
        monkeypatch.setenv("MOEMESH_KERNELS", "torch")
    else:
        force_triton(device)
    eye = torch.eye(2, dtype=torch.bfloat16, device=device)[None]  # W_UK = W_UV = I, one head
    q_nope = torch.tensor([[[1.5, 0.0]]], dtype=torch.bfloat16, device=device)
    q_pe = torch.zeros(1, 1, 2, dtype=torch.bfloat16, device=device)
    cache = torch.tensor([[[128.0, 0, 0, 0], [129.0, 8, 0, 0]]], dtype=torch.bfloat16, device=device)
    args = (q_nope, q_pe, cache, torch.tensor([[0]], device=device), torch.tensor([2], device=device), eye, eye, 1.0)
    got = (mla_decode if device == "cuda" else mla_decode_ref)(*args)
    p = torch.tensor([192.0, 193.5], dtype=torch.float64).softmax(0)
    want = p @ torch.tensor([[128.0, 0], [129.0, 8]], dtype=torch.float64)  # [128.82, 6.54]
    torch.testing.assert_close(got[0, 0].double(), want, rtol=1e-2, atol=0)
