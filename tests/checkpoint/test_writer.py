import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moemesh.shared.checkpoint.writer import init_model


def _digest(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model, tmp_path):
    again = init_model(tmp_path / "again", "tiny", seed=0)
    assert _digest(again) == _digest(Path(tiny_model))
    other = init_model(tmp_path / "other", "tiny", seed=7)
    assert _digest(other)["model.safetensors"] != _digest(again)["model.safetensors"]
    assert _digest(other)["tokenizer.json"] == _digest(again)["tokenizer.json"]


def test_every_tensor_is_randomised(tiny_model):
    tensors = load_file(f"{tiny_model}/model.safetensors")
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    for name, t in tensors.items():
        assert t.float().std() > 0, name
    # Real V3 checkpoints keep the Hub's per-expert layout and an MTP layer after the last block.
    assert "model.layers.2.mlp.experts.15.down_proj.weight" in tensors
    assert "model.layers.3.eh_proj.weight" in tensors


def test_layout_loads_in_transformers(tiny_model):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model)
    assert cfg.model_type == "deepseek_v3" and cfg.rope_parameters["rope_type"] == "yarn"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok("Hello world")["input_ids"]
    assert ids[0] == 0 and tok.decode(ids, skip_special_tokens=True) == "Hello world"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>"


def test_our_tokenizer_matches_transformers(tiny_model):
    from transformers import AutoTokenizer

    from moemesh.shared.tokenizer.tokenizer import Tokenizer

    ours, ref = Tokenizer(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "café 日本語 🙂?"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    # tools, an assistant's tool calls and the tool results, as DeepSeek's format writes them
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "user", "content": "weather <here>?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    got = ours.apply_chat_template(msgs, tools=tools)
    assert got == ref.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    # the schema as written: keys in their order, nothing HTML-escaped
    assert 'Parameters: {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}' in got
    assert "weather <here>?" in got
    assert "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}<｜tool▁call▁end｜>" in got
    text = "The expert router sends tokens → ranks."
    assert ours.encode(text) == ref(text)["input_ids"]


def test_unknown_preset_and_bad_layer_override(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        init_model(tmp_path / "x", "huge")
    with pytest.raises(ValueError, match="--num-layers"):
        init_model(tmp_path / "x", "tiny", num_layers=1)


def test_config_uses_hub_keys(tiny_model):
    raw = json.loads(Path(tiny_model, "config.json").read_text())
    assert raw["rope_scaling"]["type"] == "yarn" and "rope_theta" in raw
    assert raw["num_nextn_predict_layers"] == 1
