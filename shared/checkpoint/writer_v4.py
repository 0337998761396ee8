"""Random-weight DeepSeek-V4 checkpoints, in transformers' layout or the upstream one.

Every value is drawn from a generator seeded by (seed, our parameter name[, expert]),
so the two layouts hold the same model: tests load one through transformers and the
other through moemesh's upstream-name path and compare. `quantize` writes the upstream
layout the way the published V4-Flash stores it: FP8 e4m3 linear weights with one
power-of-two scale per 128x128 block, FP4 e2m1 routed experts with one scale per 32
inputs, and a `quantization_config` that says so.

In transformers' layout the MTP layer keeps upstream names under `mtp.0.` (transformers
itself skips those tensors, as it does for the published checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from moemesh.shared.checkpoint.names_v4 import local_to_upstream
from moemesh.shared.checkpoint.quant import quantize_fp4, quantize_fp8_block
from moemesh.shared.checkpoint.seeding import seed_for
from moemesh.shared.model.v4.config import V4Config
from moemesh.shared.model.v4.model import DeepseekV4ForCausalLM

_FP32 = ("_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias")
# Upstream FP8 weights (the compressor and indexer projections stay bf16 there).
_FP8 = ("attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.", "shared_experts.", "e_proj.", "h_proj.")
QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128]}


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed_for(seed, name))


def _value(name: str, shape: tuple[int, ...], seed: int, cfg: V4Config) -> torch.Tensor:
    """fp32 values of one of our parameters (an expert's slice when name ends in .{e})."""
    g = _gen(seed, name)
    if name.endswith("tid2eid"):  # K distinct experts per token id
        return torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(dim=1)[:, : shape[1]]
    x = torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * x
    if name.endswith(("e_score_correction_bias", "sinks", "position_bias")):
        return 0.5 * x
    if name.endswith(".scale") and "_hc" in name or name.endswith("hc_scale"):
        return 1.0 + 0.1 * x  # hyper-connection gains near 1, as training leaves them
    if name.endswith(("_hc.base", "hc_base")):
        return 0.1 * x
    if name.endswith("embed_tokens.weight"):
        return x
    if name.endswith("lm_head.weight"):
        return x * (3.0 / math.sqrt(shape[-1]))  # peaked logits: greedy choices are not near-ties
    return x / math.sqrt(shape[-1])


def _params(cfg: V4Config) -> list[tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    items = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if not n.startswith("ropes.")]
    return [(n, tuple(t.shape)) for n, t in items]


def _materialise(param: str, shape: tuple[int, ...], seed: int, cfg: V4Config) -> torch.Tensor:
    if param.endswith("mlp.experts.gate_up_proj"):
        half = (shape[1] // 2, shape[2])
        return torch.stack([torch.cat([_value(f"{param}.{e}.{p}", half, seed, cfg) for p in ("gate", "up")])
                            for e in range(shape[0])])
    if param.endswith("mlp.experts.down_proj"):
        return torch.stack([_value(f"{param}.{e}", shape[1:], seed, cfg) for e in range(shape[0])])
    return _value(param, shape, seed, cfg)


def _store(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype == torch.int64:
        return t
    return t.float() if any(k in name for k in _FP32) else t.to(dtype)


def v4_tensors(cfg: V4Config, seed: int, dtype: torch.dtype, layout: str = "hf",
               quantize: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the whole checkpoint, one parameter at a time. layout: hf, upstream,
    or ours (every tensor under our names, the MTP layer's too: transformers' in-memory
    spelling, which the transformers layout converts)."""
    if layout not in ("hf", "upstream", "ours"):
        raise ValueError(f"layout must be hf or upstream, got {layout!r}")
    for param, shape in _params(cfg):
        t = _materialise(param, shape, seed, cfg)
        if layout == "ours" or layout == "hf" and not param.startswith("mtp."):
            yield param, _store(param, t, dtype)
            continue
        names = local_to_upstream(param, cfg.n_routed_experts)
        if param.endswith("mlp.experts.gate_up_proj"):
            half = shape[1] // 2
            parts = [t[e, :half] if i % 2 == 0 else t[e, half:] for e in range(shape[0]) for i in range(2)]
        elif param.endswith("mlp.experts.down_proj"):
            parts = list(t)
        else:
            parts = [t]
        experts = ".experts." in names[0] and ".shared_experts." not in names[0]
        for name, part in zip(names, parts):
            if name.endswith("tid2eid"):
                yield name, part.to(torch.int32)
            elif quantize and experts:
                packed, scale = quantize_fp4(part.float())
                yield name, packed
                yield name.removesuffix(".weight") + ".scale", scale
            elif quantize and name.endswith(".weight") and any(k in name for k in _FP8):
                w, scale = quantize_fp8_block(part.float(), (128, 128), "ue8m0")
                yield name, w
                yield name.removesuffix(".weight") + ".scale", scale
            else:
                yield name, _store(param, part, dtype).contiguous()
