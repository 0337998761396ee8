"""The name resolvers, without any checkpoint: every spelling of every parameter reads as
that parameter, with or without the `model.` prefix, and other names read as nothing."""

from __future__ import annotations

import pytest
import torch

from moemesh.shared.checkpoint.names import Target, V3Names, local_to_hf_names
from moemesh.shared.checkpoint.names_v4 import V4Names, local_to_upstream
from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.model.deepseek import DeepseekForCausalLM
from moemesh.shared.model.v4.model import DeepseekV4ForCausalLM


def _params(preset: str):
    cfg = ModelConfig.from_dict(preset_config(preset))
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg) if cfg.model_type == "deepseek_v4" else DeepseekForCausalLM(cfg)
    items = list(model.named_parameters()) + list(model.named_buffers())
    return cfg, {n: t for n, t in items if not n.startswith(("rope.", "ropes."))}


def _pieces(param: str, names: list[str]) -> list[Target]:
    """What each per-expert name of a stacked parameter fills, in the writers' order."""
    if param.endswith("gate_up_proj"):
        return [Target(param, i // 2, ("gate", "up")[i % 2]) for i in range(len(names))]
    if param.endswith("experts.down_proj"):
        return [Target(param, i) for i in range(len(names))]
    return [Target(param)]


def _saved(preset: str, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """save_pretrained's spelling of each tensor -> the parameter it came from, by
    transformers' own conversion (what save_pretrained calls), one parameter at a time."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**preset_config(preset)))
    num_layers = hf.config.num_hidden_layers
    out = {}
    for param, t in state.items():
        ours = param
        if param.startswith("mtp.") and hf.config.model_type != "deepseek_v4":
            j, rest = param[4:].split(".", 1)  # V2/V3 keep the MTP layer after the last one
            ours = f"model.layers.{num_layers + int(j)}.{rest}"
        for name in revert_weight_conversion(hf, {ours: torch.empty(t.shape, device="meta")}):
            out[name] = param
    return out


@pytest.mark.parametrize("preset", ["tiny", "tiny-v2", "v4-tiny"])
def test_every_spelling_of_every_parameter_reads_as_it(preset):
    cfg, state = _params(preset)
    v4 = cfg.model_type == "deepseek_v4"
    names = V4Names() if v4 else V3Names(cfg.num_hidden_layers)
    saved = _saved(preset, state)
    for param, t in state.items():
        num = t.shape[0] if t.dim() else 0
        release = local_to_upstream(param, num) if v4 else local_to_hf_names(param, num, cfg.num_hidden_layers)
        spellings = [(param, [Target(param)]), (param.removeprefix("model."), [Target(param)]),
                     *[(n, [w]) for n, w in zip(release, _pieces(param, release))]]
        from_saved = [n for n, p in saved.items() if p == param]
        for name, want in spellings:
            for spelled in (name, name.removeprefix("model."), "model." + name.removeprefix("model.")):
                assert names.resolve(spelled) in want, (spelled, param)
        assert from_saved, param
        for name in from_saved:
            got = names.resolve(name)
            assert got is not None and got.param == param, (name, param)


def test_save_pretrained_spells_v4_as_issue_26_saw():
    cfg, state = _params("v4-tiny")
    saved = _saved("v4-tiny", state)
    for name in ["model.layers.0.ffn.gate.tid2eid", "model.layers.0.attn.attn_sink", "model.layers.0.attn.wkv.weight",
                 "model.layers.0.ffn.experts.3.w1.weight", "model.layers.0.hc_attn_fn", "model.hc_head.hc_fn",
                 "model.embed_tokens.weight", "head.weight", "model.layers.1.attn.indexer.compressor.ape"]:
        assert name in saved, name
    v4 = V4Names()
    assert v4.resolve("model.layers.0.ffn.experts.3.w1.weight") == Target("model.layers.0.mlp.experts.gate_up_proj", 3,
                                                                          "gate")
    assert v4.resolve("model.layers.1.attn.indexer.compressor.ape") == Target(
        "model.layers.1.self_attn.compressor.indexer.position_bias")


def test_norms_keep_their_meaning_whatever_the_prefix():
    v4 = V4Names()
    # The final norms are not KV norms, the MTP layer's included (transformers never loads that one).
    assert v4.resolve("norm.weight") == v4.resolve("model.norm.weight") == Target("model.norm.weight")
    assert v4.resolve("mtp.0.norm.weight") == Target("mtp.0.norm.weight")
    for spelled in ("layers.2.attn.kv_norm.weight", "model.layers.2.attn.norm.weight",
                    "model.layers.2.self_attn.kv_norm.weight"):
        assert v4.resolve(spelled) == Target("model.layers.2.self_attn.kv_norm.weight"), spelled
    assert v4.resolve("layers.1.attn.indexer.compressor.norm.weight") == Target(
        "model.layers.1.self_attn.compressor.indexer.kv_norm.weight")


@pytest.mark.parametrize("name", ["vision_tower.proj.weight", "model.foo", "layers.x.attn.wq_a.weight", "embed.bias",
                                  "model.model.layers.0.attn.wq_a.weight"])
def test_names_no_rule_reads(name):
    assert V4Names().resolve(name) is None
    assert V3Names(3).resolve(name) is None


def test_v3_mtp_layers_follow_the_target_layers():
    v3 = V3Names(3)
    assert v3.resolve("model.layers.3.eh_proj.weight") == Target("mtp.0.eh_proj.weight")
    assert v3.resolve("layers.4.mlp.experts.2.up_proj.weight") == Target("mtp.1.mlp.experts.gate_up_proj", 2, "up")
    assert v3.resolve("model.layers.2.mlp.experts.down_proj") == Target("model.layers.2.mlp.experts.down_proj")
