"""Norms hold their weight where the reference model does: DeepSeek-V4's in fp32, which
multiplies before the one rounding to the serving dtype; V2/V3's in the model's dtype,
which multiplies the rounded value (shared/kernels/rmsnorm.py)."""

from __future__ import annotations

import torch

from moemesh.shared.checkpoint.loader import load_model
from moemesh.shared.model.layers import RMSNorm


def _norms(model: torch.nn.Module) -> dict[str, RMSNorm]:
    return {n: m for n, m in model.named_modules() if isinstance(m, RMSNorm)}


def test_v4_norms_keep_fp32_weights_in_a_bf16_model(tiny_v4_model):
    norms = _norms(load_model(tiny_v4_model, torch.bfloat16))
    # Two a block, the attention's q and kv, each compressor's and indexer's, the final
    # norm and the MTP layer's own three.
    assert len(norms) == 29
    assert [n for n, m in norms.items() if m.weight.dtype != torch.float32 or not m.fp32_weight] == []
    exact = dict(load_model(tiny_v4_model).named_parameters())  # loaded as the checkpoint holds them, unrounded
    assert [n for n, m in norms.items() if not torch.equal(m.weight, exact[f"{n}.weight"])] == []


def test_v3_norms_keep_the_model_dtype(tiny_model):
    norms = _norms(load_model(tiny_model, torch.bfloat16))
    assert norms and all(m.weight.dtype == torch.bfloat16 and not m.fp32_weight for m in norms.values())


def test_v4_norm_output_is_in_the_input_dtype():
    norm = RMSNorm(8, fp32_weight=True)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert norm.weight.dtype == torch.float32 and norm(x).dtype == torch.bfloat16
