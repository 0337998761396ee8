import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moemesh.shared.checkpoint.loader import CheckpointError, load_model
from moemesh.shared.checkpoint.writer import init_model


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model, d)
    return d


def _rewrite(d, fn):
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f))


def test_missing_tensor_is_named(model_copy):
    _rewrite(model_copy, lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        load_model(model_copy)


def test_missing_single_expert_is_named(model_copy):
    _rewrite(model_copy, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors model\.layers\.2\.mlp\.experts\.gate_up_proj"):
        load_model(model_copy)


def test_unexpected_tensor_is_named(model_copy):
    _rewrite(model_copy, lambda t: t.__setitem__("model.layers.0.self_attn.rotary.inv_freq", torch.zeros(4)))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn\.rotary\.inv_freq'"):
        load_model(model_copy)


def test_expert_beyond_config_is_named(model_copy):
    _rewrite(model_copy, lambda t: t.__setitem__("model.layers.1.mlp.experts.99.down_proj.weight", torch.zeros(64, 32)))
    with pytest.raises(CheckpointError, match="names expert 99, but the config has 16"):
        load_model(model_copy)


def test_shape_mismatch_is_named(model_copy):
    _rewrite(model_copy, lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' has shape \(65,\), expected \(64,\)"):
        load_model(model_copy)


def test_unsupported_model_type(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'mixtral'"):
        load_model(model_copy)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "empty"])
def test_corrupt_file_is_named(model_copy, damage):
    f = model_copy / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "garbage_header":
        f.write_bytes(data[:8] + b"\xff" * 64 + data[72:])
    else:
        f.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: "):
        load_model(model_copy)


def test_missing_directory_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "config.json").write_text((json.dumps({"model_type": "deepseek_v3"})))
    with pytest.raises(CheckpointError, match="missing required key"):
        load_model(tmp_path)


def test_sharded_and_fused_layouts_load_the_same_weights(tiny_model, tmp_path):
    base = load_model(tiny_model)
    sharded = init_model(tmp_path / "sharded", "tiny", seed=0, shard_size=256 << 10)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    fused = init_model(tmp_path / "fused", "tiny", seed=0, fused_experts=True)
    names = load_file(str(fused / "model.safetensors")).keys()
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    for d in (sharded, fused):
        other = load_model(d)
        for (n, a), (_, b) in zip(base.state_dict().items(), other.state_dict().items()):
            assert torch.equal(a, b), n


def test_index_naming_a_missing_shard(tiny_model, tmp_path):
    d = init_model(tmp_path / "s", "tiny", seed=0, shard_size=256 << 10)
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-.*which does not exist"):
        load_model(d)


def test_checkpoint_without_mtp_layer_turns_drafting_off(model_copy):
    _rewrite(model_copy, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.3.")])
    m = load_model(model_copy)
    assert not m.cfg.has_mtp and len(m.mtp) == 0


def test_mtp_copies_of_embedding_and_head_are_optional(model_copy):
    def drop(t):
        t.pop("model.layers.3.embed_tokens.weight")
        t.pop("model.layers.3.shared_head.head.weight")
    _rewrite(model_copy, drop)
    m = load_model(model_copy)
    assert m.mtp[0].embed_tokens.weight is m.model.embed_tokens.weight


def test_bf16_load_keeps_router_in_fp32(tiny_model):
    m = load_model(tiny_model, dtype=torch.bfloat16)
    moe = m.model.layers[1].mlp
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.dtype == torch.float32


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_v4_model"])
def test_building_the_model_imports_no_compiler(request, fixture):
    """The model is built on the meta device and then loaded: no parameter fill and no
    computed table may run on meta tensors there, whose first use imports torch._dynamo
    (a second of a worker's start on two cores)."""
    import subprocess
    import sys

    code = ("import sys; from moemesh.shared.checkpoint.loader import load_model; "
            f"load_model({request.getfixturevalue(fixture)!r}); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_models_built_at_once_in_threads_leave_torchs_init_as_it_was(tiny_model):
    # Two services in one process build their models in threads at the same time.
    from concurrent.futures import ThreadPoolExecutor

    originals = (torch.nn.init.normal_, torch.nn.init.kaiming_uniform_)
    with ThreadPoolExecutor(4) as pool:
        models = list(pool.map(lambda _: load_model(tiny_model), range(4)))
    assert (torch.nn.init.normal_, torch.nn.init.kaiming_uniform_) == originals
    assert all(torch.equal(m.lm_head.weight, models[0].lm_head.weight) for m in models)
