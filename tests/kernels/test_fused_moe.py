from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.fused_moe import (_fused_moe_kernel, _moe_align_kernel, _moe_combine_kernel, fused_moe,
                                              fused_moe_ref, moe_align, moe_align_ref)
from tests.kernels.cases import DEVICE_DTYPES, GPU, check, launches, randn

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (5e-2, 5e-2)}
KERNELS = (_fused_moe_kernel, _moe_combine_kernel)


def _weights(S, D, I, dtype, device, seed=0):
    w13 = randn(S, 2 * I, D, dtype=dtype, device=device, seed=seed, scale=D**-0.5)
    w2 = randn(S, D, I, dtype=dtype, device=device, seed=seed + 1, scale=I**-0.5)
    return w13, w2


def _routing(T, K, S, device, seed=0, held=1.0):
    """Distinct slots per token, as a top-k gives; a fraction 1 - held of them is -1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, S, generator=g).argsort(dim=1)[:, :K]
    ids = torch.where(torch.rand(T, K, generator=g) < held, ids, -1)
    return ids.to(device), torch.rand(T, K, generator=g).to(device)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("T,D,I,S,K", [(1, 7, 5, 3, 1), (7, 24, 10, 5, 3), (123, 33, 20, 9, 4), (7, 16, 8, 4, 4)])
def test_matches_reference(force_triton, device, dtype, T, D, I, S, K):
    force_triton(device)
    x = randn(T, D, dtype=dtype, device=device, seed=T)
    w13, w2 = _weights(S, D, I, dtype, device)
    ids, w = _routing(T, K, S, device, held=0.8)
    with launches(*KERNELS):
        got = fused_moe(x, w13, w2, ids, w)
    check(got, fused_moe_ref(x, w13, w2, ids, w), TOL)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_swiglu_limit_clips_gate_and_up(force_triton, device, dtype):
    """DeepSeek-V4 clips gate (above) and up (both sides) before the product; weights
    scaled up so that most pre-activations pass the limit and the clip decides."""
    force_triton(device)
    T, D, I, S, K = 37, 24, 12, 6, 3
    x = randn(T, D, dtype=dtype, device=device, seed=5, scale=4.0)
    w13, w2 = _weights(S, D, I, dtype, device, seed=6)
    ids, w = _routing(T, K, S, device, seed=7)
    with launches(*KERNELS):
        got = fused_moe(x, w13, w2, ids, w, limit=0.5)
    want = fused_moe_ref(x, w13, w2, ids, w, limit=0.5)
    check(got, want, TOL)
    assert (want - fused_moe_ref(x, w13, w2, ids, w)).abs().max() > 0.1  # the clip changed something


def _swiglu_clipped(x, w13, w2, limit):
    """One expert, by the definition: silu(min(g, L)) * clamp(u, -L, L)."""
    inter = w13.shape[0] // 2
    h = x @ w13.T
    g, u = h[:, :inter].clamp(max=limit), h[:, inter:].clamp(-limit, limit)
    return (torch.nn.functional.silu(g) * u) @ w2.T


def test_reference_clip_is_the_definition():
    x = torch.randn(5, 8) * 3
    w13, w2 = _weights(1, 8, 4, torch.float32, "cpu")
    got = fused_moe_ref(x, w13, w2, torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1), limit=0.7)
    torch.testing.assert_close(got, _swiglu_clipped(x, w13[0], w2[0], 0.7))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_skewed_routing_leaves_experts_empty(force_triton, device, dtype):
    """Every token to slots 0 and 6 of 8: six slots get nothing, two get a long run that
    spans several M-blocks."""
    force_triton(device)
    T, D, I, S = 123, 24, 16, 8
    x = randn(T, D, dtype=dtype, device=device, seed=1)
    w13, w2 = _weights(S, D, I, dtype, device, seed=2)
    ids = torch.tensor([[6, 0]] * T, device=device)
    w = torch.rand(T, 2, generator=torch.Generator().manual_seed(3)).to(device)
    with launches(*KERNELS):
        got = fused_moe(x, w13, w2, ids, w)
    check(got, fused_moe_ref(x, w13, w2, ids, w), TOL)


def test_tokens_with_no_expert_held_here_come_back_zero(force_triton):
    force_triton("cpu")
    x = torch.randn(7, 16)
    w13, w2 = _weights(4, 16, 8, torch.float32, "cpu")
    ids = torch.tensor([[-1, -1]] * 3 + [[2, -1]] * 4)
    with launches(*KERNELS):
        got = fused_moe(x, w13, w2, ids, torch.rand(7, 2))
    assert torch.equal(got[:3], torch.zeros(3, 16))
    assert got[3:].abs().sum() > 0


def test_no_tokens(force_triton):
    force_triton("cpu")
    w13, w2 = _weights(4, 16, 8, torch.float32, "cpu")
    out = fused_moe(torch.zeros(0, 16), w13, w2, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 16)


@pytest.mark.parametrize("kernel", [False, True])
def test_align_pads_each_slot_to_whole_blocks(force_triton, monkeypatch, kernel):
    if kernel:
        force_triton("cpu")
    else:
        monkeypatch.setenv("MOEMESH_KERNELS", "torch")
    ids = torch.tensor([[2, 0], [2, -1], [2, 1]])  # slot 2 x3, slots 0 and 1 x1, one pair dropped
    pairs, block_slot = moe_align(ids, num_slots=4, block_m=2)
    P = ids.numel()
    # The grid covers the worst case without a host sync: ceil(P / block_m) blocks plus
    # one partial block per slot in use, and at most min(num_slots, P) slots are in use.
    assert block_slot.tolist() == [0, 1, 2, 2, -1, -1, -1]
    assert pairs[:8].tolist() == [1, P, 5, P, 0, 2, 4, P]
    assert (pairs[8:] == P).all()
    assert moe_align(ids, num_slots=256, block_m=2)[1].numel() == 3 + P


@pytest.mark.parametrize("T,K,S,block_m", [(1, 1, 1, 16), (7, 2, 8, 16), (123, 8, 256, 16), (64, 6, 64, 32),
                                           (300, 4, 16, 64), (5, 3, 9, 2)])
def test_align_kernel_equals_the_reference(force_triton, T, K, S, block_m):
    force_triton("cpu")
    g = torch.Generator().manual_seed(T * S)
    ids = torch.randint(-1, S, (T, K), generator=g)  # -1: held by another rank
    with launches(_moe_align_kernel):
        pairs, block_slot = moe_align(ids, S, block_m)
    want_pairs, want_slot = moe_align_ref(ids, S, block_m)
    assert torch.equal(pairs, want_pairs) and torch.equal(block_slot, want_slot)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_bf16_weights_and_sum_stay_fp32(force_triton, monkeypatch, device):
    """Each expert's output rounds to bf16 (its GEMM's output); the fp32 routing weights
    and the sum over a token's experts do not: one rounding at the end, as transformers'
    experts combine. Rounding the weights and each product first is off on most values."""
    if device == "cpu":
        monkeypatch.setenv("MOEMESH_KERNELS", "torch")
    else:
        force_triton(device)
    T, D, I, S, K = 64, 32, 16, 8, 4
    x = randn(T, D, dtype=torch.bfloat16, device=device, seed=11)
    w13, w2 = _weights(S, D, I, torch.bfloat16, device, seed=12)
    ids, w = _routing(T, K, S, device, seed=13)
    w = w * 2.5  # a routed scaling factor: weights that bf16 does not hold
    got = fused_moe(x, w13, w2, ids, w)
    experts = torch.stack([fused_moe_ref(x, w13, w2, ids[:, k:k + 1], torch.ones(T, 1, device=device))
                           for k in range(K)], dim=1)  # [T, K, D], each expert's output in bf16
    want = (experts.float() * w.float()[..., None]).sum(dim=1).to(torch.bfloat16)
    # Another summation order may move a value by its last place; the old rounding moved half.
    assert (got != want).float().mean() <= 0.02
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)
