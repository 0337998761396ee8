"""DeepSeek-V4 config.json parsing: both spellings, held to transformers' DeepseekV4Config.

transformers derives the same architecture from the same dict (layer schedule, compress
rates, MoE schedule, rotary split, the "main" and "compress" rope tables); every config
here is parsed by both and the results compared field by field, the rope tables by the
inverse frequencies and attention factor they produce.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.model.config import ConfigError, ModelConfig
from moemesh.shared.model.v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, V4Config
from moemesh.shared.model.v4.layout import V4Layout
from moemesh.shared.model.v4.rope import Rope


def _base(**over) -> dict:
    """A small architecture in neither spelling yet: the per-layer keys come from `over`."""
    raw = preset_config("v4-tiny")
    for k in ("layer_types", "compress_rates", "mlp_layer_types", "partial_rotary_factor", "rope_scaling"):
        raw.pop(k)
    raw.update(over)
    return raw


_LEGACY_SCHEDULE = _base(  # upstream spelling, another schedule, MTP entry at the end
    num_hidden_layers=7,
    head_dim=64,
    qk_rope_head_dim=16,
    compress_ratios=[0, 4, 4, 128, 0, 128, 4, 0],
    num_hash_layers=1,
    hc_mult=2,
    hc_sinkhorn_iters=7,
    hc_eps=1e-5,
    num_attention_heads=8,
    o_groups=4,
    sliding_window=32,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=16,
    rope_theta=5000.0,
    compress_rope_theta=40000.0,
    rope_scaling=dict(type="yarn", factor=8.0, original_max_position_embeddings=512, beta_fast=16, beta_slow=2),
)
_LEGACY_RATES = _base(  # upstream scalar rates, no schedule at all: the default one
    num_hidden_layers=6,
    compress_rate_csa=8,
    compress_rate_hca=32,
    num_hash_layers=0,
    qk_rope_head_dim=4,
    hc_mult=1,
    rope_scaling=dict(type="yarn", factor=2.0, original_max_position_embeddings=2048, mscale=1.0,
                      mscale_all_dim=0.5),
)
_LEGACY_MANY_HASH = _base(num_hidden_layers=3, compress_ratios=[128, 4, 0], num_hash_layers=5,
                          qk_rope_head_dim=8)
_CURRENT = _base(  # current spelling: other rates, a non-prefix MoE schedule, nested ropes
    num_hidden_layers=5,
    layer_types=[CSA, SLIDING, HCA, CSA, HCA],
    compress_rates={CSA: 2, HCA: 8},
    mlp_layer_types=[MOE, HASH_MOE, MOE, HASH_MOE, MOE],
    partial_rotary_factor=0.5,
    hc_mult=3,
    o_groups=1,
    index_n_heads=4,
    index_head_dim=24,
    index_topk=3,
    sliding_window=16,
    rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 20000.0},
        "compress": {"rope_type": "yarn", "rope_theta": 80000.0, "factor": 8.0,
                     "original_max_position_embeddings": 512, "beta_fast": 24, "beta_slow": 2},
    },
)
_CURRENT_YARN_MAIN = _base(  # both tables YaRN; mscale ratio for the main one
    num_hidden_layers=4,
    layer_types=[SLIDING, SLIDING, HCA, CSA],
    compress_rates={CSA: 4, HCA: 16},
    mlp_layer_types=[HASH_MOE, MOE, MOE, MOE],
    partial_rotary_factor=0.125,
    num_attention_heads=8,
    o_groups=8,
    rope_parameters={
        "main": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                 "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 0.8},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                     "original_max_position_embeddings": 256, "attention_factor": 1.0},
    },
)
_NO_ROPE_SCALING = _base(num_hidden_layers=4, layer_types=[HCA, CSA, HCA, CSA], partial_rotary_factor=0.25)

CONFIGS = {
    "v4-tiny": preset_config("v4-tiny"),
    "v4-flash": preset_config("v4-flash"),
    "v4-flash-5-layers": preset_config("v4-flash", num_layers=5),
    "legacy-schedule": _LEGACY_SCHEDULE,
    "legacy-rates": _LEGACY_RATES,
    "legacy-many-hash": _LEGACY_MANY_HASH,
    "current": _CURRENT,
    "current-yarn-main": _CURRENT_YARN_MAIN,
    "no-rope-scaling": _NO_ROPE_SCALING,
}


def _hf(raw: dict):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**copy.deepcopy(raw))  # transformers edits nested dicts in place


def _parse(raw: dict, source: str = "x/config.json") -> V4Config:
    cfg = ModelConfig.from_dict(copy.deepcopy(raw), source=source)
    assert isinstance(cfg, V4Config)
    return cfg


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parsed_fields_match_transformers(name):
    raw = CONFIGS[name]
    cfg, hf = _parse(raw), _hf(raw)
    assert list(cfg.layer_types) == hf.layer_types
    assert list(cfg.mlp_layer_types) == hf.mlp_layer_types
    assert cfg.rate(CSA) == hf.compress_rates[CSA]
    assert cfg.rate(HCA) == hf.compress_rates[HCA]
    for i, t in enumerate(hf.layer_types):
        assert cfg.compress_rate(i) == (0 if t == SLIDING else hf.compress_rates[t])
        assert cfg.is_hash_layer(i) == (hf.mlp_layer_types[i] == HASH_MOE)
    assert cfg.qk_rope_head_dim == hf.qk_rope_head_dim
    for key in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "n_routed_experts",
                "n_shared_experts", "num_experts_per_tok", "scoring_func", "norm_topk_prob",
                "routed_scaling_factor", "swiglu_limit", "rms_norm_eps", "max_position_embeddings",
                "num_nextn_predict_layers"):
        assert getattr(cfg, key) == getattr(hf, key), key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rope_tables_match_transformers(name):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    raw = CONFIGS[name]
    cfg, hf = _parse(raw), _hf(raw)
    ref = DeepseekV4RotaryEmbedding(hf)
    for kind, ours in (("main", cfg.rope_main), ("compress", cfg.rope_compress)):
        p = hf.rope_parameters[kind]
        assert ours.theta == p["rope_theta"], kind
        assert ours.kind == p["rope_type"], kind
        if ours.kind == "yarn":
            assert ours.factor == p["factor"]
            assert ours.original_max_position_embeddings == p["original_max_position_embeddings"]
            assert ours.beta_fast == (p.get("beta_fast") or 32)
            assert ours.beta_slow == (p.get("beta_slow") or 1)
            assert ours.attention_factor == p.get("attention_factor")
        rope = Rope(ours, cfg.qk_rope_head_dim)
        inv_ref = getattr(ref, f"{kind}_inv_freq")
        assert rope.inv_freq.shape == inv_ref.shape == (cfg.qk_rope_head_dim // 2,)
        torch.testing.assert_close(rope.inv_freq, inv_ref, rtol=1e-6, atol=0)
        assert rope.attention_factor == pytest.approx(getattr(ref, f"{kind}_attention_scaling"), rel=1e-12)


def test_configs_cover_what_they_claim():
    """The table above exercises what it says: otherwise the comparisons prove little."""
    parsed = {n: _parse(r) for n, r in CONFIGS.items()}
    assert {c.rate(CSA) for c in parsed.values()} >= {2, 4, 8}
    assert {c.rate(HCA) for c in parsed.values()} >= {8, 16, 32, 128}
    assert {sum(map(c.is_hash_layer, range(c.num_hidden_layers))) for c in parsed.values()} >= {0, 1, 2, 3}
    assert {c.hc_mult for c in parsed.values()} >= {1, 2, 3, 4}
    assert {c.o_groups for c in parsed.values()} >= {1, 2, 4, 8}
    assert {c.qk_rope_head_dim / c.head_dim for c in parsed.values()} >= {0.125, 0.25, 0.5}
    assert parsed["current-yarn-main"].rope_main.kind == "yarn"
    assert parsed["current"].rope_compress.attention_factor is None  # computed from the factor
    assert parsed["no-rope-scaling"].rope_compress.kind == "default"
    assert parsed["legacy-rates"].layer_types == (HCA, HCA, HCA, CSA, HCA, CSA)  # the default schedule
    assert parsed["legacy-many-hash"].mlp_layer_types == (HASH_MOE,) * 3




@pytest.mark.parametrize("key", [
    "head_dim", "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
    "hc_eps", "n_shared_experts", "scoring_func", "norm_topk_prob", "swiglu_limit", "rms_norm_eps",
    "tie_word_embeddings", "bos_token_id",
    "routed_scaling_factor", "max_position_embeddings",
])
def test_omitted_key_defaults_like_transformers(key):
    raw = preset_config("v4-tiny")
    del raw[key]
    assert getattr(_parse(raw), key) == getattr(_hf(raw), key)


def test_omitted_schedule_and_rope_keys_default_like_transformers():
    raw = preset_config("v4-tiny")
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_scaling",
                "rope_theta", "compress_rope_theta"):
        del raw[key]
    cfg, hf = _parse(raw), _hf(raw)
    assert list(cfg.layer_types) == hf.layer_types == [HCA, HCA, HCA, CSA]
    assert list(cfg.mlp_layer_types) == hf.mlp_layer_types == [HASH_MOE] * 3 + [MOE]
    assert dict(cfg.compress_rates) == hf.compress_rates
    assert cfg.qk_rope_head_dim == hf.qk_rope_head_dim == 4  # 32 * 64 / 512
    assert cfg.rope_main.theta == hf.rope_parameters["main"]["rope_theta"] == 10000.0
    assert cfg.rope_compress.theta == hf.rope_parameters["compress"]["rope_theta"] == 160000.0
    assert cfg.rope_compress.kind == hf.rope_parameters["compress"]["rope_type"] == "default"


# ---- the two spellings ---------------------------------------------------------------

def _to_current(raw: dict) -> dict:
    """An upstream-spelling dict rewritten in the current spelling (same architecture)."""
    out = copy.deepcopy(raw)
    n = out["num_hidden_layers"]
    rates = {CSA: out.pop("compress_rate_csa", 4), HCA: out.pop("compress_rate_hca", 128)}
    by_rate = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
    out["layer_types"] = [by_rate[r] for r in out.pop("compress_ratios")[:n]]
    out["compress_rates"] = rates
    n_hash = out.pop("num_hash_layers")
    out["mlp_layer_types"] = [HASH_MOE if i < n_hash else MOE for i in range(n)]
    out["partial_rotary_factor"] = out.pop("qk_rope_head_dim") / out["head_dim"]
    scaling = dict(out.pop("rope_scaling"))
    kind = scaling.pop("type")
    out["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": out.pop("rope_theta")},
        "compress": {"rope_type": kind, "rope_theta": out.pop("compress_rope_theta"), **scaling,
                     "attention_factor": 1.0},  # what a flat rope_scaling means for V4
    }
    return out


def _to_legacy(raw: dict) -> dict:
    """A current-spelling dict rewritten in the upstream spelling."""
    out = copy.deepcopy(raw)
    rates = out.pop("compress_rates")
    rate = {SLIDING: 0, **rates}
    out["compress_ratios"] = [rate[t] for t in out.pop("layer_types")] + [0]  # the MTP layer's entry
    out["compress_rate_csa"], out["compress_rate_hca"] = rates[CSA], rates[HCA]
    mlp = out.pop("mlp_layer_types")
    out["num_hash_layers"] = mlp.count(HASH_MOE)
    assert mlp == sorted(mlp, key=lambda t: t != HASH_MOE)  # expressible: hash layers first
    out["qk_rope_head_dim"] = int(out["head_dim"] * out.pop("partial_rotary_factor"))
    return out


@pytest.mark.parametrize("name", ["v4-flash", "legacy-schedule"])
def test_upstream_and_current_spelling_parse_equal(name):
    legacy = CONFIGS[name]
    current = _to_current(legacy)
    assert "compress_ratios" not in current and "rope_scaling" not in current
    a, b = _parse(legacy), _parse(current)
    assert a.identity() == b.identity()
    assert a == b
    # transformers' own serialisation of either reads back the same
    assert _parse(_hf(current).to_dict()).identity() == a.identity()
    assert _parse(_hf(legacy).to_dict()).identity() == a.identity()


def test_v4_tiny_in_upstream_spelling_parses_equal():
    current = preset_config("v4-tiny")
    legacy = _to_legacy(current)
    assert "layer_types" not in legacy and "compress_rates" not in legacy
    assert legacy["compress_ratios"] == [0, 4, 16, 4, 0]
    assert _parse(legacy).identity() == _parse(current).identity()


def test_spellings_differ_when_the_architecture_does():
    """identity() is sensitive to what the spellings carry (so the equalities above mean something)."""
    base = _parse(CONFIGS["v4-flash"]).identity()
    for change in ({"num_hash_layers": 2}, {"qk_rope_head_dim": 32}, {"compress_rope_theta": 10000.0},
                   {"compress_ratios": [0, 4] + [4, 128] * 20 + [4, 0]}):
        assert _parse(CONFIGS["v4-flash"] | change).identity() != base, change


# ---- errors ------------------------------------------------------------------------

@pytest.mark.parametrize("patch,needle", [
    ({"layer_types": [SLIDING, CSA, "full_attention", CSA]}, "layer_types must be a list of"),
    ({"mlp_layer_types": [HASH_MOE, "dense", MOE, MOE]}, "mlp_layer_types must be a list of"),
    ({"layer_types": [SLIDING, CSA, HCA]}, "layer_types has 3 entries for 4 layers"),
    ({"mlp_layer_types": [HASH_MOE, MOE]}, "mlp_layer_types has 2 entries for 4 layers"),
    ({"compress_rates": {CSA: 0, HCA: 16}}, "compress_rates"),
    ({"compress_rates": {"sliding_attention": 4}}, "compress_rates"),
    ({"scoring_func": "relu"}, "scoring_func 'relu' is not supported"),
    ({"num_attention_heads": 6, "o_groups": 4}, "num_attention_heads=6 is not divisible by o_groups=4"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
    ({"partial_rotary_factor": 5 / 32}, "rotary part"),  # 5 rotary channels: not pairs
    ({"partial_rotary_factor": 1.5}, "rotary part"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope type 'longrope'"),
])
def test_bad_current_spelling_names_the_key(patch, needle):
    raw = preset_config("v4-tiny") | patch
    with pytest.raises(ConfigError, match=needle) as e:
        _parse(raw, source="models/x/config.json")
    assert str(e.value).startswith("models/x/config.json: ")


@pytest.mark.parametrize("patch,needle", [
    ({"compress_ratios": [0, 0] + [4, 128] * 20 + [8, 0]}, r"compress_ratios must list 0 \(sliding\), 4 \(CSA\) "
                                                          r"or 128 \(HCA\) per layer"),
    ({"compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "compress_rate_csa": 8}, "compress_ratios must list"),
    ({"compress_ratios": "0,4,128"}, "compress_ratios must list"),
    ({"compress_rate_hca": -128}, "compress_rates"),
    ({"num_hash_layers": -1}, "num_hash_layers"),
    ({"qk_rope_head_dim": 63}, "rotary part"),
])
def test_bad_upstream_spelling_names_the_key(patch, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        _parse(preset_config("v4-flash") | patch, source="models/x/config.json")
    assert str(e.value).startswith("models/x/config.json: ")


def test_short_compress_ratios_names_compress_ratios():
    raw = preset_config("v4-flash") | {"compress_ratios": [0, 0, 4, 128]}
    with pytest.raises(ConfigError, match="compress_ratios"):
        _parse(raw)


# ---- V4-Flash ------------------------------------------------------------------------

def test_v4_flash_facts():
    cfg = _parse(preset_config("v4-flash"))
    assert cfg.num_hidden_layers == 43 and cfg.num_cache_layers == 44
    assert cfg.layer_types[:2] == (SLIDING, SLIDING)
    assert cfg.layer_types[2:] == (CSA, HCA) * 20 + (CSA,)
    assert cfg.layer_types[-1] == CSA
    assert cfg.layer_type(43) == SLIDING and cfg.compress_rate(43) == 0  # the MTP layer: window only
    assert [i for i in range(43) if cfg.is_hash_layer(i)] == [0, 1, 2]
    assert cfg.rate(CSA) == 4 and cfg.rate(HCA) == 128 and cfg.used_rates == (4, 128)
    assert cfg.block_multiple == 128
    assert cfg.lookback == 127  # max(window 128 - 1, CSA 2*4 - 1, HCA 128 - 1)
    assert cfg.qk_rope_head_dim == 64 and cfg.head_dim == 512
    assert cfg.rope_main.kind == "default" and cfg.rope_main.theta == 10000.0
    assert cfg.rope_compress.kind == "yarn" and cfg.rope_compress.theta == 160000.0
    assert cfg.rope_compress.factor == 16 and cfg.rope_compress.attention_factor == 1.0


def test_v4_flash_trimmed():
    raw = preset_config("v4-flash", num_layers=5)
    cfg = _parse(raw)
    assert cfg.num_hidden_layers == 5 and len(cfg.layer_types) == len(cfg.mlp_layer_types) == 5
    assert cfg.layer_types == (SLIDING, SLIDING, CSA, HCA, CSA)
    assert cfg.mlp_layer_types == (HASH_MOE,) * 3 + (MOE,) * 2
    assert cfg.layer_type(5) == SLIDING  # MTP
    current = preset_config("v4-tiny", num_layers=2)
    assert current["layer_types"] == [SLIDING, CSA] and current["mlp_layer_types"] == [HASH_MOE, HASH_MOE]
    assert _parse(current).layer_types == (SLIDING, CSA)
    with pytest.raises(ValueError, match="at most 43"):
        preset_config("v4-flash", num_layers=44)


def test_v4_flash_layout_sizes():
    cfg = _parse(preset_config("v4-flash"))
    lay = V4Layout(cfg, 128)
    n_csa, n_hca = cfg.layer_types.count(CSA), cfg.layer_types.count(HCA)
    assert (n_csa, n_hca, len(lay.layers)) == (21, 20, 44)
    # Main row: per CSA layer 32 entries of 512 plus 32 index keys of 128; per HCA layer one entry.
    assert lay.main_width == n_csa * (32 * 512 + 32 * 128) + n_hca * 512 == 440320
    # Per token, bf16: 3440 values (CSA 512/4 + 128/4 each, HCA 512/128 each).
    assert lay.bytes_per_token(torch.bfloat16) == (n_csa * 160 + n_hca * 4) * 2 == 6880
    # Ring: every layer's last W-1 keys; CSA's two series of kv|gate and the indexer's for a
    # group and the one before (2m-1 positions); HCA's one series for a group (m'-1); each
    # with 2 slots for positions written ahead (no drafts here).
    assert lay.ring_width == 44 * 129 * 512 + n_csa * 9 * (4 * 512 + 4 * 128) + n_hca * 129 * 2 * 512
    assert lay.ring_bytes(torch.bfloat16) == lay.ring_width * 2
    assert lay.carry_width == 44 * 127 * 512 + n_csa * 7 * (4 * 512 + 4 * 128) + n_hca * 127 * 2 * 512
    # Regions tile both rows without overlap.
    for rows, width in (("main", lay.main_width), ("window", lay.ring_width)):
        regions = sorted(
            (r.offset, r.offset + r.size) for layer in lay.layers
            for r in ((layer.entries, layer.index_keys) if rows == "main" else
                      (layer.window_kv, layer.proj, layer.index_proj)) if r is not None)
        assert regions[0][0] == 0 and regions[-1][1] == width
        assert all(a[1] == b[0] for a, b in zip(regions, regions[1:]))
    assert lay.layers[43].layer_type == SLIDING and lay.layers[43].entries is None
    assert lay.layers[2].entries.count == 32 and lay.layers[3].entries.count == 1
    with pytest.raises(ValueError, match="multiple of every compress rate"):
        V4Layout(cfg, 64)
    assert math.lcm(*cfg.used_rates) == cfg.block_multiple
