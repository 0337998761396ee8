from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.v4_attention import (_v4_decode_attn_kernel, attend_ref, v4_decode_attention,
                                                 v4_decode_attention_ref)
from tests.kernels.cases import DEVICE_DTYPES, GPU, check, launches, randn

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}


def _case(B, H, d, W, per_block, mode, dtype, device, J=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = randn(B, H, d, dtype=dtype, device=device, seed=seed)
    ctx = randn(B + 20, d, dtype=dtype, device=device, seed=seed + 1)
    win = torch.randint(0, B + 20, (B, W), generator=g)
    win[:, : W // 2] = torch.where(torch.rand(B, W // 2, generator=g) < 0.5, -1, win[:, : W // 2])  # before 0
    win[:, -1] = torch.arange(B)  # each row sees itself
    sinks = randn(H, dtype=torch.float32, device=device, seed=seed + 2)
    kw = {}
    if mode != "window":
        blocks = 12
        # a strided view of wider main rows, as the cache holds them
        main = randn(blocks, 3 * per_block * d + 7, dtype=dtype, device=device, seed=seed + 3)
        entries = main[:, 5 : 5 + per_block * d].view(blocks, per_block, d)
        nb = 3
        table = torch.stack([torch.randperm(blocks, generator=g)[:nb] for _ in range(B)])
        visible = torch.randint(0, nb * per_block + 1, (B,), generator=g)
        kw = dict(entries=entries, table=table.to(device), visible=visible.to(device), count=nb * per_block)
        if mode == "selected":
            kw["sel"] = torch.stack([torch.randperm(nb * per_block, generator=g)[:J] for _ in range(B)]).to(device)
    return (q, ctx, win.to(device), sinks, d ** -0.5), kw


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("mode", ["window", "all", "selected"])
@pytest.mark.parametrize("B,H,d,W,per_block", [(1, 4, 32, 8, 4), (7, 3, 16, 8, 1), (5, 17, 48, 40, 2)])
def test_matches_reference(force_triton, device, dtype, mode, B, H, d, W, per_block):
    force_triton(device)
    args, kw = _case(B, H, d, W, per_block, mode, dtype, device)
    with launches(_v4_decode_attn_kernel):
        got = v4_decode_attention(*args, **kw)
    check(got, v4_decode_attention_ref(*args, **kw), TOL)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_bf16_scores_sink_and_softmax_stay_fp32(force_triton, monkeypatch, device):
    """Scores 192 and 193.5 against a sink of 192.75: bf16's spacing there is 1, so rounded
    they read 192, 194 and 193, and a sixth of the weight moves. The model's torch path
    (rows with their own keys, and a chunk's rows sharing theirs), the reference and the
    kernel keep them in fp32."""
    if device == "cpu":
        monkeypatch.setenv("MOEMESH_KERNELS", "torch")
    else:
        force_triton(device)
    bf16 = dict(dtype=torch.bfloat16, device=device)
    q = torch.tensor([[[1.5, 0.0]]], **bf16)  # one row, one head
    keys = torch.tensor([[128.0, 0], [129.0, 8]], **bf16)  # also the values
    sinks = torch.tensor([192.75], device=device)
    p = torch.tensor([192.0, 193.5, 192.75], dtype=torch.float64).softmax(0)[:2]
    want = p @ keys.double().cpu()  # [100.9, 4.23]
    win = torch.tensor([[0, 1]], device=device)
    got = [v4_decode_attention(q, keys, win, sinks, 1.0)]
    if device == "cpu":
        mask = torch.ones(1, 2, dtype=torch.bool)
        got += [attend_ref(q, keys[None], mask, sinks, 1.0), attend_ref(q, keys, mask, sinks, 1.0)]
    for g in got:
        torch.testing.assert_close(g[0, 0].double().cpu(), want, rtol=1e-2, atol=0)
