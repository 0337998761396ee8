"""DEP-N: greedy fp32 outputs equal DEP1's, with gloo all-to-all between rank processes."""

from __future__ import annotations

import random

import pytest
import torch.multiprocessing as mp

from moemesh.tools.launch.procs import free_port
from tests.engine.dep_worker import run_rank


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(4, 970) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def _dep(model_dir, world, redundant, prompts, max_tokens, num_spec, phy2log=None, info=None):
    """Outputs by request id of a DEP instance; `info` (a list) gets each rank's facts."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=run_rank, args=(r, world, init, model_dir, prompts, redundant, max_tokens,
                                                  num_spec, q, phy2log)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=240) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    outs, steps = {}, set()
    for rank, o, n, freed, facts in sorted(results, key=lambda r: r[0]):
        if info is not None:
            info.append(facts)
        outs.update(o)
        steps.add(n)
        assert freed, f"rank {rank} leaked KV blocks"
    assert len(steps) == 1, f"ranks stepped different numbers of times: {steps}"
    return outs


@pytest.mark.parametrize("world,redundant,num_spec", [(2, 0, 1), (2, 1, 2), (4, 1, 1)])
def test_dep_outputs_equal_dep1(tiny_engine_factory, tiny_model, world, redundant, num_spec):
    prompts = _prompts(6 if world == 4 else 5)
    max_tokens = 8
    from moemesh.shared.protocol.sampling import SamplingParams

    eng = tiny_engine_factory(num_speculative_tokens=num_spec)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    want = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            want[o.request_id] += o.new_token_ids
    got = _dep(tiny_model, world, redundant, prompts, max_tokens, num_spec)
    assert got == want


def test_dep_v4_outputs_equal_dep1_hash_layers_included(tiny_v4_model):
    """DeepSeek-V4 under DEP2 with a redundant slot: every layer is MoE, the first two
    hash-routed, and all of them go through the all-to-all."""
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.protocol.sampling import SamplingParams

    prompts = _prompts(5, seed=3)
    eng = LLMEngine(EngineConfig(model=tiny_v4_model, num_kv_blocks=256, num_speculative_tokens=1))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    want = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            want[o.request_id] += o.new_token_ids
    assert _dep(tiny_v4_model, 2, 1, prompts, 8, 1) == want


def _greedy(eng, prompts, max_tokens) -> dict[str, list[int]]:
    from moemesh.shared.protocol.sampling import SamplingParams

    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    out = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_dep2_starts_on_a_checkpoint_whose_config_declares_an_mtp_layer_it_lacks(tiny_model, tmp_path):
    """The config says one MTP layer; the weights have none. One engine starts with MTP
    off, and so must a DEP instance: its placement is sized from the model as loaded
    (two MoE layers), not from the config (three)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.model.config import ModelConfig

    d = tmp_path / "no-mtp"
    shutil.copytree(tiny_model, d)
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    mtp = f"model.layers.{ModelConfig.from_dir(d).num_hidden_layers}."
    assert any(k.startswith(mtp) for k in tensors)
    save_file({k: t for k, t in tensors.items() if not k.startswith(mtp)}, str(f))
    assert ModelConfig.from_dir(d).has_mtp  # the config still declares it

    prompts = _prompts(4, seed=5)
    eng = LLMEngine(EngineConfig(model=str(d), num_kv_blocks=256, num_speculative_tokens=1))
    assert not eng.use_mtp
    want = _greedy(eng, prompts, 6)
    info: list[dict] = []
    assert _dep(str(d), 2, 1, prompts, 6, 1, info=info) == want
    assert [(i["num_moe_layers"], i["has_mtp"]) for i in info] == [(2, False), (2, False)]
