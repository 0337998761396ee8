"""Every DeepSeek checkpoint transformers writes, moemesh loads, and the other way round.

transformers builds a small random V2, V3 and V4 model (V4 with hash-routed layers,
every attention type and hyper-connections; transformers builds no MTP layer for any of
them) and saves it with save_pretrained: one file, shards with an index, without the
`model.` prefix, and re-saved after loading a checkpoint of another spelling. moemesh
must load each to transformers' own values and give its greedy ids. The other way,
transformers loads each layout init-model writes, and init-model's `transformers`
layout is what save_pretrained writes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moemesh.shared.checkpoint.loader import CheckpointError, load_model
from moemesh.shared.checkpoint.writer import init_model
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.protocol.messages import SamplingParams
from tests.checkpoint.hf_built import PRESETS, reference

# V4: past the sliding window (8) and one HCA block (16), and across two of them.
LENS = {"v2": [1, 7, 33], "v3": [1, 7, 33], "v4": [3, 9, 17, 40]}
NEW = 8


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _hf(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


def _equal_to_transformers(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """Every parameter transformers has, moemesh has with the same value; moemesh's only
    other parameters are the rotary tables it computes."""
    assert set(theirs) <= set(ours)
    assert all(k.startswith(("rope.", "ropes.")) for k in set(ours) - set(theirs))
    for k, t in theirs.items():
        assert torch.equal(ours[k].to(t.dtype), t), k


def _bare(src: str, dst: Path) -> Path:
    """The checkpoint with every `model.` prefix stripped."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    save_file({k.removeprefix("model."): v for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch", list(PRESETS))
@pytest.mark.parametrize("variant", ["one file", "shards", "no model. prefix"])
def test_save_pretrained_output_loads_to_transformers_values(hf_saved, arch, variant, tmp_path):
    single = hf_saved(arch)
    if variant == "shards":
        d = Path(hf_saved(arch, max_shard_size="64KB"))
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 3
    elif variant == "no model. prefix":
        d = _bare(single, tmp_path / "bare")
        assert not any(k.startswith("model.") for k in _tensors(d))
    else:
        d = Path(single)
        assert not (d / "model.safetensors.index.json").exists()
    if arch == "v4":  # what save_pretrained writes: upstream leaf names under transformers' prefixes
        pre = "" if variant == "no model. prefix" else "model."
        assert {f"{pre}layers.0.ffn.gate.tid2eid", f"{pre}layers.0.attn.attn_sink", "head.weight"} <= set(_tensors(d))
    _equal_to_transformers(load_model(d).state_dict(), _hf(single).state_dict())


@pytest.mark.parametrize("arch", list(PRESETS))
def test_greedy_ids_equal_transformers(hf_saved, arch):
    d = hf_saved(arch)
    prompts, want = reference(_hf(d), 3, LENS[arch], NEW)
    eng = LLMEngine(EngineConfig(model=d, num_kv_blocks=256, num_speculative_tokens=0,
                                 max_num_batched_tokens=24), model=load_model(d))
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(1000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


# ---- moemesh's checkpoints in transformers ------------------------------------------

_LAYOUTS = [("tiny-v2", "hf"), ("tiny-v2", "transformers"), ("tiny", "hf"), ("tiny", "fused"),
            ("tiny", "transformers"), ("v4-tiny", "hf"), ("v4-tiny", "upstream"), ("v4-tiny", "transformers")]


def _init(tmp_path, preset, layout) -> Path:
    if layout == "fused":
        return init_model(tmp_path / layout, preset, seed=4, fused_experts=True)
    return init_model(tmp_path / layout, preset, seed=4, layout=layout)


@pytest.mark.parametrize("preset,layout", _LAYOUTS)
def test_transformers_loads_what_init_model_writes_and_its_resave_loads_back(tmp_path, preset, layout):
    from transformers import AutoModelForCausalLM

    d = _init(tmp_path, preset, layout)
    hf, info = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    # transformers builds no MTP layer: V3's (the layer after the last) is all it may skip.
    assert all(k.startswith(f"model.layers.{hf.config.num_hidden_layers}.") for k in info["unexpected_keys"])
    ours = load_model(d).state_dict()
    for k, t in hf.state_dict().items():
        assert torch.equal(t, ours[k].to(t.dtype)), k
    # A user's round trip: loaded in transformers, saved again. save_pretrained reverses
    # only the conversions the load used, so the names mix the two spellings.
    hf.save_pretrained(tmp_path / "resaved")
    _equal_to_transformers(load_model(tmp_path / "resaved").state_dict(), hf.state_dict())


@pytest.mark.parametrize("preset", ["tiny-v2", "tiny", "v4-tiny"])
def test_init_models_transformers_layout_is_what_save_pretrained_writes(tmp_path, preset):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = init_model(tmp_path / "ours", preset, seed=4, layout="transformers")
    assert json.loads((d / "moemesh_init.json").read_text())["layout"] == "transformers"
    state = load_model(d).state_dict()
    weights = {k: v for k, v in state.items() if not k.startswith(("mtp.", "ropes.", "rope."))}
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(d)), dtype=torch.float32)
    hf.load_state_dict(weights, strict=True)  # a model transformers built, not loaded: no conversion recorded
    hf.save_pretrained(tmp_path / "theirs")
    ours, theirs = _tensors(d), _tensors(tmp_path / "theirs")
    mtp = set(ours) - set(theirs)  # transformers writes no MTP layer; ours is spelled as its rules spell it
    assert set(theirs) <= set(ours)
    assert bool(mtp) == any(k.startswith("mtp.") for k in state)  # tiny-v2 has none
    assert all(k.startswith(("mtp.0.", f"model.layers.{hf.config.num_hidden_layers}.")) for k in mtp)
    for k, t in theirs.items():
        assert torch.equal(ours[k].to(t.dtype), t), k


def test_the_default_layout_is_transformers_where_it_is_installed(tmp_path):
    d = init_model(tmp_path / "d", "v4-tiny", seed=0)
    assert json.loads((d / "moemesh_init.json").read_text())["layout"] == "transformers"
    assert "model.layers.0.ffn.gate.tid2eid" in _tensors(d)
    q = init_model(tmp_path / "q", "v4-tiny", seed=0, quantize=True)
    assert json.loads((q / "moemesh_init.json").read_text())["layout"] == "upstream"


def test_without_transformers_the_default_is_hf_and_asking_for_its_layout_is_an_error(tmp_path, monkeypatch):
    from moemesh.shared.checkpoint import writer_transformers

    monkeypatch.setattr(writer_transformers, "available", lambda: False)
    d = init_model(tmp_path / "d", "tiny-v2", seed=0)
    assert json.loads((d / "moemesh_init.json").read_text())["layout"] == "hf"
    with pytest.raises(ValueError, match="--layout transformers needs transformers installed"):
        init_model(tmp_path / "e", "tiny-v2", seed=0, layout="transformers")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="--fused-experts writes transformers' in-memory names"):
        init_model(tmp_path / "f", "tiny", seed=0, layout="transformers", fused_experts=True)


# ---- errors ------------------------------------------------------------------------------

def _edited(src: str, dst: Path, edit=None, edit_config=None) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    if edit is not None:
        st = load_file(str(f))
        edit(st)
        save_file(st, str(f), metadata={"format": "pt"})
    if edit_config is not None:
        raw = json.loads((dst / "config.json").read_text())
        edit_config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _vocab(d: str) -> int:
    return json.loads((Path(d) / "config.json").read_text())["vocab_size"]


def _one_line_error(d: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_one_parameter_in_two_spellings_is_refused(hf_saved, tmp_path):
    def twice(st):
        st["model.layers.0.self_attn.q_a_proj.weight"] = st["model.layers.0.attn.wq_a.weight"].clone()

    msg = _one_line_error(_edited(hf_saved("v4"), tmp_path / "bad", twice))
    assert "'model.layers.0.attn.wq_a.weight'" in msg and "'model.layers.0.self_attn.q_a_proj.weight'" in msg
    assert "both hold model.layers.0.self_attn.q_a_proj.weight" in msg and "mixes two layouts" in msg


def test_fused_experts_beside_per_expert_ones_are_refused(hf_saved, tmp_path):
    def fused_too(st):
        w1 = [st[f"model.layers.2.ffn.experts.{e}.w1.weight"] for e in range(8)]
        w3 = [st[f"model.layers.2.ffn.experts.{e}.w3.weight"] for e in range(8)]
        st["model.layers.2.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(p) for p in zip(w1, w3)])

    msg = _one_line_error(_edited(hf_saved("v4"), tmp_path / "bad", fused_too))
    assert "model.layers.2.mlp.experts.gate_up_proj (expert 0)" in msg and "mixes two layouts" in msg


def test_a_hash_layer_without_its_routing_table_is_named(hf_saved, tmp_path):
    msg = _one_line_error(_edited(hf_saved("v4"), tmp_path / "bad",
                                  lambda st: st.pop("model.layers.1.ffn.gate.tid2eid")))
    assert msg == ("model.safetensors: layer 1 is hash-routed (mlp_layer_types[1] is 'hash_moe') but its routing "
                   "table is missing: expected tensor 'model.layers.1.ffn.gate.tid2eid', integers of shape "
                   f"[vocab_size, num_experts_per_tok] = [{_vocab(hf_saved('v4'))}, 2]")


@pytest.mark.parametrize("table,needle", [
    (lambda v: torch.zeros(v, 3, dtype=torch.long), "has shape ({v}, 3), but a hash routing table is [vocab_size, "
                                                    "num_experts_per_tok] = [{v}, 2] by the config"),
    (lambda v: torch.zeros(v + 1, 2, dtype=torch.long), "has shape ({v1}, 2)"),
    (lambda v: torch.zeros(v, 2), "is stored as torch.float32; a hash routing table holds expert ids, as integers"),
    (lambda v: torch.full((v, 2), 8, dtype=torch.int32), "routes to expert 8, but the config has 8 routed experts "
                                                        "(0..7)"),
    (lambda v: torch.full((v, 2), -1, dtype=torch.long), "routes to expert -1"),
])
def test_a_routing_table_that_disagrees_with_the_config_is_named(hf_saved, tmp_path, table, needle):
    v = _vocab(hf_saved("v4"))
    needle = needle.format(v=v, v1=v + 1)

    def put(st):
        st["model.layers.0.ffn.gate.tid2eid"] = table(v)

    msg = _one_line_error(_edited(hf_saved("v4"), tmp_path / "bad", put))
    assert msg.startswith("model.safetensors: tensor 'model.layers.0.ffn.gate.tid2eid' ") and needle in msg


def test_a_routing_table_for_a_layer_routed_by_score_is_named(hf_saved, tmp_path):
    def one_hash_layer(raw):
        raw["mlp_layer_types"] = ["hash_moe", "moe", "moe", "moe"]

    msg = _one_line_error(_edited(hf_saved("v4"), tmp_path / "bad", edit_config=one_hash_layer))
    assert "tensor 'model.layers.1.ffn.gate.tid2eid' is a hash routing table, but the config routes that layer " \
           "by score (hash-routed layers: 0" in msg


def test_a_name_no_rule_reads_is_named(hf_saved, tmp_path):
    msg = _one_line_error(_edited(hf_saved("v4"), tmp_path / "bad",
                                  lambda st: st.__setitem__("vision_tower.proj.weight", torch.zeros(2))))
    assert msg == "model.safetensors: unexpected tensor 'vision_tower.proj.weight' (no deepseek_v4 tensor is named so)"


def test_a_tensor_in_two_shards_or_misplaced_by_the_index_is_named(hf_saved, tmp_path):
    src = Path(hf_saved("v3", max_shard_size="64KB"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name, fname = next(iter(sorted(index["weight_map"].items())))
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != fname)

    twice = tmp_path / "twice"
    shutil.copytree(src, twice)
    st = load_file(str(twice / other))
    st[name] = load_file(str(twice / fname))[name]
    save_file(st, str(twice / other), metadata={"format": "pt"})
    assert f"tensor {name!r} is stored twice, in" in _one_line_error(twice)

    moved = tmp_path / "moved"
    shutil.copytree(src, moved)
    index["weight_map"][name] = other
    (moved / "model.safetensors.index.json").write_text(json.dumps(index))
    assert f"lists tensor {name!r} in {other}, which does not hold it" in _one_line_error(moved)
