"""DeepSeek-V4 checkpoints: transformers' layout, the upstream one, FP8/FP4 storage, errors.

The writer draws every value from (seed, parameter name), so the layouts of one seed hold
the same model; the loader must bring each of them to the same parameters, and
transformers must read the hf layout into the same values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moemesh.shared.checkpoint.loader import CheckpointError, load_model
from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.checkpoint.writer import init_model
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.model.v4.config import V4Config
from moemesh.shared.model.v4.layout import V4Layout

SEED = 5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4-layouts")
    return {
        "hf": init_model(root / "hf", "v4-tiny", seed=SEED, layout="hf"),
        "transformers": init_model(root / "transformers", "v4-tiny", seed=SEED, layout="transformers"),
        "upstream": init_model(root / "upstream", "v4-tiny", seed=SEED, layout="upstream"),
        "quantized": init_model(root / "quantized", "v4-tiny", seed=SEED, layout="upstream", quantize=True),
    }


@pytest.fixture(scope="module")
def states(dirs) -> dict[str, dict[str, torch.Tensor]]:
    return {k: load_model(d).state_dict() for k, d in dirs.items()}


def _names(d: Path) -> dict[str, str]:
    """tensor name -> safetensors dtype string, as stored."""
    with open(d / "model.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_layouts_use_different_names(dirs):
    hf, up = set(_names(dirs["hf"])), set(_names(dirs["upstream"]))
    assert "model.layers.0.self_attn.q_a_proj.weight" in hf and "layers.0.attn.wq_a.weight" in up
    assert "model.layers.1.mlp.experts.gate_up_proj" in hf and "layers.1.ffn.experts.7.w3.weight" in up
    shared = hf & up
    assert shared and all(n.startswith("mtp.0.") for n in shared)  # the MTP layer keeps upstream names


@pytest.mark.parametrize("layout", ["upstream", "transformers"])
def test_every_layout_loads_identically(states, layout):
    a, b = states["hf"], states[layout]
    assert set(a) == set(b)
    assert any(k.startswith("mtp.0.") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_seed_changes_the_weights(tmp_path, states):
    other = load_model(init_model(tmp_path / "other", "v4-tiny", seed=SEED + 1)).state_dict()
    ours = states["hf"]
    differ = [k for k in ours if not torch.equal(ours[k], other[k])]
    assert len(differ) > 0.9 * len(ours)


@pytest.mark.parametrize("layout", ["hf", "upstream", "transformers"])
def test_transformers_loads_every_layout_to_the_same_values(dirs, states, layout):
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(str(dirs[layout]), dtype=torch.float32,
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]
    theirs, ours = model.state_dict(), states[layout]
    assert set(theirs) <= set(ours)
    extra = set(ours) - set(theirs)
    assert extra and all(k.startswith("mtp.") for k in extra)
    for k, t in theirs.items():
        assert t.shape == ours[k].shape, k
        assert torch.equal(t.to(ours[k].dtype), ours[k]), k
    assert "model.layers.0.mlp.gate.tid2eid" in theirs  # hash routing tables are compared too


# ---- FP8 / FP4 ------------------------------------------------------------------------

def test_quantized_config_and_storage(dirs):
    raw = json.loads((dirs["quantized"] / "config.json").read_text())
    qc = raw["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3" and qc["weight_block_size"] == [128, 128]
    assert qc["scale_fmt"] == "ue8m0" and raw["expert_dtype"] == "fp4"
    assert "quantization_config" not in json.loads((dirs["upstream"] / "config.json").read_text())
    names = _names(dirs["quantized"])
    fp8 = {n for n, dt in names.items() if dt == "F8_E4M3"}
    fp4 = {n for n, dt in names.items() if dt == "I8"}
    assert "layers.0.attn.wq_a.weight" in fp8 and "layers.3.ffn.shared_experts.w2.weight" in fp8
    assert "mtp.0.e_proj.weight" in fp8
    assert {f"layers.1.ffn.experts.{e}.w{w}.weight" for e in range(8) for w in (1, 2, 3)} <= fp4
    for w in fp8 | fp4:
        assert names[w.removesuffix(".weight") + ".scale"] == "F8_E8M0", w
    scales = {n for n in names if n.endswith(".scale")}
    assert {s.removesuffix(".scale") + ".weight" for s in scales} == fp8 | fp4
    # The compressors and indexers stay unquantized, as upstream.
    assert names["layers.1.attn.compressor.wkv.weight"] == "F32"
    assert names["layers.1.attn.indexer.wq_b.weight"] == "F32"
    with safe_open(str(dirs["quantized"] / "model.safetensors"), "pt") as f:
        w = f.get_tensor("layers.1.ffn.experts.0.w1.weight")
        s = f.get_tensor("layers.1.ffn.experts.0.w1.scale")
        assert w.shape == (32, 32) and s.shape == (32, 2)  # [out, in / 2] packed, one scale per 32 inputs
        w = f.get_tensor("layers.0.attn.wq_b.weight")
        s = f.get_tensor("layers.0.attn.wq_b.scale")
        assert w.shape == (128, 32) and s.shape == (1, 1)  # [out, in], one scale per 128x128 block


def _fp8_bound(w: torch.Tensor) -> torch.Tensor:
    """|error| allowed per element of an e4m3 weight with a power-of-two scale per 128x128
    block: half an ulp (2^-4 relative) for normal values, and the subnormal step below."""
    out, inp = w.shape
    bound = torch.empty_like(w)
    for i in range(0, out, 128):
        for j in range(0, inp, 128):
            blk = w[i:i + 128, j:j + 128]
            scale = 2.0 ** torch.ceil(torch.log2(blk.abs().max() / 448.0))
            bound[i:i + 128, j:j + 128] = blk.abs() * 2.0**-4 + scale * 2.0**-10
    return bound


def _fp4_bound(w: torch.Tensor) -> torch.Tensor:
    """e2m1 with a power-of-two scale per 32 inputs: values map into [-6, 6] where the
    grid 0, .5, 1, 1.5, 2, 3, 4, 6 leaves at most max(1/4, |v|/4) of rounding."""
    g = w.view(w.shape[0], -1, 32)
    scale = 2.0 ** torch.ceil(torch.log2(g.abs().amax(dim=-1, keepdim=True) / 6.0))
    return torch.maximum(g.abs() / 4, 0.25 * scale).view_as(w)


def test_quantized_loads_within_the_format_error(dirs, states):
    q, exact = states["quantized"], states["upstream"]
    assert set(q) == set(exact)
    names = _names(dirs["quantized"])
    from moemesh.shared.checkpoint.names_v4 import V4Names

    fp8 = {V4Names().resolve(n).param for n, dt in names.items() if dt == "F8_E4M3"}
    fp4 = {V4Names().resolve(n).param for n, dt in names.items() if dt == "I8"}
    assert fp8 and fp4 and not fp8 & fp4
    for k in q:
        a, b = q[k], exact[k]
        assert a.shape == b.shape and a.dtype == b.dtype, k
        if k in fp8:
            err = (a - b).abs()
            assert (err <= _fp8_bound(b)).all(), k
            rel = err.max() / b.abs().max()
            assert 0 < rel <= 2.0**-4, k  # it is quantized, and only that much
        elif k in fp4:
            for e in range(b.shape[0]):
                err = (a[e] - b[e]).abs()
                assert (err <= _fp4_bound(b[e])).all(), (k, e)
            assert (a != b).any(), k
        else:
            assert torch.equal(a, b), k
    exact_kinds = ("norm.weight", "_hc.", "hc_head.", "e_score_correction_bias", "tid2eid", "sinks", "position_bias")
    for kind in exact_kinds:
        hits = [k for k in q if kind in k]
        assert hits and not any(k in fp8 | fp4 for k in hits), kind


def test_quantized_values_are_on_the_grid(states):
    """Each dequantized FP4 group of 32 is its power-of-two scale times e2m1 codes, and each
    FP8 block its scale times e4m3 values: the loader applied the scales it read."""
    q, exact = states["quantized"], states["upstream"]
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    a = q["model.layers.1.mlp.experts.down_proj"].reshape(-1, 32)
    b = exact["model.layers.1.mlp.experts.down_proj"].reshape(-1, 32)
    scale = 2.0 ** torch.ceil(torch.log2(b.abs().amax(dim=1, keepdim=True) / 6.0))
    codes = a.abs() / scale
    assert torch.isclose(codes[..., None], grid, rtol=0, atol=1e-6).any(dim=-1).all()
    w = q["model.layers.0.self_attn.q_b_proj.weight"]  # one 128x128 block (partial)
    ref = exact["model.layers.0.self_attn.q_b_proj.weight"]
    scaled = w / 2.0 ** torch.ceil(torch.log2(ref.abs().max() / 448.0))
    assert torch.equal(scaled.to(torch.float8_e4m3fn).float(), scaled)
    assert scaled.abs().max() <= 448


# ---- errors -------------------------------------------------------------------------

def _variant(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of checkpoint src with its tensors and/or config.json rewritten."""
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        st = load_file(str(dst / "model.safetensors"))
        edit_tensors(st)
        save_file(st, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        raw = json.loads((dst / "config.json").read_text())
        edit_config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _grow(name: str, dim: int = 0):
    def edit(st):
        t = st[name]
        shape = list(t.shape)
        shape[dim] += 1
        st[name] = torch.zeros(shape, dtype=t.dtype)
    return edit


def _drop(name: str):
    return lambda st: st.pop(name)


def _add(name: str):
    return lambda st: st.__setitem__(name, torch.zeros(4))


@pytest.mark.parametrize("layout,edit,needles", [
    ("hf", _drop("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"),
     ["missing tensors", "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"]),
    ("hf", _drop("model.layers.2.mlp.experts.gate_up_proj"), ["missing tensors",
                                                             "model.layers.2.mlp.experts.gate_up_proj"]),
    ("hf", _grow("model.layers.2.self_attn.kv_proj.weight"),
     ["model.safetensors: tensor 'model.layers.2.self_attn.kv_proj.weight' has shape (33, 64), "
      "expected (32, 64)"]),
    ("upstream", _grow("layers.2.attn.wkv.weight", 1),
     ["model.safetensors: tensor 'layers.2.attn.wkv.weight' has shape (32, 65), expected (32, 64)"]),
    ("upstream", _grow("layers.3.ffn.experts.5.w2.weight"),
     ["model.safetensors: tensor 'layers.3.ffn.experts.5.w2.weight' has shape (65, 32), expected (64, 32)"]),
    ("quantized", _grow("layers.2.attn.wkv.scale"),
     ["model.safetensors: tensor 'layers.2.attn.wkv.weight': scale has shape (2, 1), expected (1, 1)"]),
    ("quantized", _grow("layers.2.ffn.experts.0.w1.scale", 1),
     ["model.safetensors: tensor 'layers.2.ffn.experts.0.w1.weight': scale has shape (32, 3), expected (32, 2)"]),
    ("hf", _add("model.layers.0.self_attn.bogus.weight"),
     ["model.safetensors: unexpected tensor 'model.layers.0.self_attn.bogus.weight'"]),
    ("upstream", _add("layers.0.attn.bogus.weight"),
     ["model.safetensors: unexpected tensor 'layers.0.attn.bogus.weight'"]),
    ("upstream", _add("layers.9.attn_norm.weight"),  # a layer the config does not have
     ["model.safetensors: unexpected tensor 'layers.9.attn_norm.weight'"]),
    ("upstream", _add("layers.0.ffn.experts.8.w1.weight"),
     ["model.safetensors: tensor 'layers.0.ffn.experts.8.w1.weight' names expert 8, but the config has 8"]),
])
def test_bad_tensors_name_the_file_and_tensor(dirs, tmp_path, layout, edit, needles):
    bad = _variant(dirs[layout], tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    for needle in needles:
        assert needle in str(e.value)


def test_missing_upstream_tensor_is_named(dirs, tmp_path):
    bad = _variant(dirs["upstream"], tmp_path / "bad", edit_tensors=_drop("layers.1.attn.indexer.wq_b.weight"))
    with pytest.raises(CheckpointError, match="missing tensors") as e:
        load_model(bad)
    assert str(bad) in str(e.value)
    # Named as the model's parameter (the upstream name it came from is layers.1.attn.indexer.wq_b.weight).
    assert "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight" in str(e.value)


@pytest.mark.parametrize("layout", ["hf", "quantized"])
def test_unsupported_quant_method_names_the_key(dirs, tmp_path, layout):
    def awq(raw):
        raw["quantization_config"] = {**raw.get("quantization_config", {}), "quant_method": "awq"}

    bad = _variant(dirs[layout], tmp_path / "bad", edit_config=awq)
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    assert str(e.value) == f"{bad / 'config.json'}: quantization_config.quant_method 'awq' is not supported (fp8)"


def test_scale_on_an_unquantized_weight_is_refused(dirs, tmp_path):
    def f32(st):
        st["layers.0.attn.wq_a.weight"] = st["layers.0.attn.wq_a.weight"].float()

    bad = _variant(dirs["quantized"], tmp_path / "bad", edit_tensors=f32)
    with pytest.raises(CheckpointError, match="model.safetensors: tensor 'layers.0.attn.wq_a.weight' has a scale "
                                              "but is stored as torch.float32"):
        load_model(bad)


def test_fp8_weight_without_its_scale_is_refused(dirs, tmp_path):
    bad = _variant(dirs["quantized"], tmp_path / "bad", edit_tensors=_drop("layers.0.attn.wq_a.scale"))
    with pytest.raises(CheckpointError, match="layers.0.attn.wq_a"):
        load_model(bad)


# ---- V4-Flash, without writing it ------------------------------------------------------

def test_v4_flash_parses_and_lays_out():
    cfg = ModelConfig.from_dict(preset_config("v4-flash"))
    assert isinstance(cfg, V4Config)
    lay = V4Layout(cfg, 128)
    assert len(lay.layers) == cfg.num_cache_layers == 44
    assert lay.main_width == 440320  # 21 CSA layers * (32*512 + 32*128) + 20 HCA layers * 512
    # A million-token context's compressed cache in bf16: 6880 bytes per token, about 6.7 GiB.
    assert lay.bytes_per_token(torch.bfloat16) * 2**20 / 2**30 == pytest.approx(6.72, abs=0.01)
    # Recent-position state per sequence, independent of its length: about 11.5 MiB.
    assert lay.ring_bytes(torch.bfloat16) / 2**20 == pytest.approx(11.50, abs=0.01)
    csa = lay.layers[2]
    assert (csa.entries.count, csa.entries.width, csa.index_keys.count, csa.index_keys.width) == (32, 512, 32, 128)
    assert (csa.proj.width, csa.index_proj.width) == (4 * 512, 4 * 128)  # kv|gate of Ca and Cb
    hca = lay.layers[3]
    assert (hca.entries.count, hca.proj.width, hca.index_keys) == (1, 2 * 512, None)
