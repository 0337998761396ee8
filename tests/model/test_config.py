import json

import pytest

from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.model.config import ConfigError, ModelConfig
from moemesh.shared.model.rope import inv_freq_and_attention_factor, softmax_scale


def test_older_rope_scaling_and_current_rope_parameters_parse_the_same():
    old = preset_config("tiny")
    new = dict(old)
    scaling = new.pop("rope_scaling")
    new["rope_parameters"] = {**{("rope_type" if k == "type" else k): v for k, v in scaling.items()},
                              "rope_theta": new.pop("rope_theta")}
    a, b = ModelConfig.from_dict(old), ModelConfig.from_dict(new)
    assert a.rope == b.rope
    assert a.rope.kind == "yarn" and a.rope.factor == 4.0


def test_yarn_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = preset_config("tiny")
    hf = DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    inv_ref, attn_ref = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = ModelConfig.from_dict(raw)
    inv, attn = inv_freq_and_attention_factor(cfg.rope, cfg.qk_rope_head_dim)
    assert (inv - inv_ref).abs().max() < 1e-9
    assert attn == pytest.approx(attn_ref)
    assert softmax_scale(cfg) > cfg.qk_head_dim ** -0.5  # mscale_all_dim bumps the scale


@pytest.mark.parametrize("patch,needle", [
    ({"model_type": "llama"}, "unsupported model_type 'llama'"),
    ({"hidden_size": "big"}, "hidden_size must be a non-negative integer"),
    ({"n_group": 3}, "not divisible by n_group"),
    ({"topk_group": 9}, "topk_group=9"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"num_nextn_predict_layers": 2}, "MTP layer"),
])
def test_bad_configs_say_what_is_wrong(patch, needle):
    raw = preset_config("tiny") | patch
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        ModelConfig.from_dict(raw, source="x/config.json")


def test_missing_key_names_it():
    raw = preset_config("tiny")
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="missing required key 'kv_lora_rank'"):
        ModelConfig.from_dict(raw)


def test_from_dir_reports_bad_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny-v2")))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.q_lora_rank is None and cfg.scoring_func == "softmax" and not cfg.has_mtp


def test_cache_footprint_is_latent_plus_rope():
    cfg = ModelConfig.from_dict(preset_config("v3"))
    assert cfg.kv_cache_dim == 512 + 64  # per token per layer, vs 128 heads * (192 + 128) uncompressed
    assert cfg.num_cache_layers == 62
