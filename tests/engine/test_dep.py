"""DEP-N: greedy fp32 outputs equal DEP1's, with gloo all-to-all between rank processes."""

from __future__ import annotations

import random

import pytest

from tests.engine.dep_worker import RankPool


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(4, 970) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def ranks():
    """Rank processes shared by this file's instances (one spawn, one torch import, each)."""
    pool = RankPool(4)
    yield pool
    pool.close()


def _dep(ranks, model_dir, world, redundant, prompts, max_tokens, num_spec, phy2log=None, info=None,
         placement="linear"):
    """Outputs by request id of a DEP instance; `info` (a list) gets each rank's facts."""
    results = ranks.run(world, model_dir, prompts, redundant, max_tokens, num_spec, phy2log=phy2log,
                        placement=placement)
    outs, steps = {}, set()
    for rank, o, n, freed, facts in results:
        if info is not None:
            info.append(facts)
        outs.update(o)
        steps.add(n)
        assert freed, f"rank {rank} leaked KV blocks"
    assert len(steps) == 1, f"ranks stepped different numbers of times: {steps}"
    return outs


@pytest.mark.parametrize("world,redundant,num_spec,placement",
                         [(2, 0, 1, "linear"), (2, 1, 2, "round_robin"), (4, 1, 1, "linear")])
def test_dep_outputs_equal_dep1(ranks, tiny_engine_factory, tiny_model, world, redundant, num_spec, placement):
    prompts = _prompts(6 if world == 4 else 5)
    max_tokens = 8
    from moemesh.shared.protocol.messages import SamplingParams

    eng = tiny_engine_factory(num_speculative_tokens=num_spec)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    want = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            want[o.request_id] += o.new_token_ids
    got = _dep(ranks, tiny_model, world, redundant, prompts, max_tokens, num_spec, placement=placement)
    assert got == want


def test_dep_v4_outputs_equal_dep1_hash_layers_included(ranks, tiny_v4_model):
    """DeepSeek-V4 under DEP2 with a redundant slot: every layer is MoE, the first two
    hash-routed, and all of them go through the all-to-all."""
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.protocol.messages import SamplingParams

    prompts = _prompts(5, seed=3)
    eng = LLMEngine(EngineConfig(model=tiny_v4_model, num_kv_blocks=256, num_speculative_tokens=1))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    want = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            want[o.request_id] += o.new_token_ids
    assert _dep(ranks, tiny_v4_model, 2, 1, prompts, 8, 1) == want


def _greedy(eng, prompts, max_tokens) -> dict[str, list[int]]:
    from moemesh.shared.protocol.messages import SamplingParams

    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    out = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_dep2_starts_on_a_checkpoint_whose_config_declares_an_mtp_layer_it_lacks(ranks, tiny_model, tmp_path):
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
    assert _dep(ranks, str(d), 2, 1, prompts, 6, 1, info=info) == want
    assert [(i["num_moe_layers"], i["has_mtp"]) for i in info] == [(2, False), (2, False)]


def test_a_skewed_hash_layer_is_balanced_through_replicas(ranks, tiny_v4_model):
    """A hash layer's routing follows the token ids, so only replicas can even it out.
    Prompts of tokens whose hash row puts expert 3 second make it hot in layer 0; the
    policy gives it a replica on each rank, the DEP2 ranks split its pairs between them,
    the balance measured on the ranks is the one the policy predicted, and every output
    stays what one engine gives."""
    import torch

    from moemesh.shared.checkpoint.loader import load_model
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.engine.load_tracker import LoadTracker
    from moemesh.shared.eplb.placement import Placement, naive_placement
    from moemesh.shared.eplb.policy import build_placement

    hot, world, redundant = 3, 2, 1
    model = load_model(tiny_v4_model)
    table = model.model.layers[0].mlp.gate.tid2eid  # [vocab, K]
    tokens = [t for t in (table[:, 1] == hot).nonzero().flatten().tolist() if t >= 4]
    rng = random.Random(7)
    prompts = [[0] + [rng.choice(tokens) for _ in range(rng.randrange(20, 30))] for _ in range(4)]

    eng = LLMEngine(EngineConfig(model=tiny_v4_model, num_kv_blocks=256, num_speculative_tokens=1), model=model)
    tracker = LoadTracker(eng.model, window_steps=10_000)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, _sp(6))
    want = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            want[o.request_id] += o.new_token_ids
        tracker.end_step()
    loads = tracker.window().double()  # [L + MTP, E]
    num_layers, E = loads.shape

    naive = naive_placement(num_layers, E, world, redundant)
    placed = build_placement(loads, world, redundant)
    assert int(placed.replica_counts()[0, hot]) >= 2
    before, after = naive.layer_ratios(loads), placed.layer_ratios(loads)
    assert before[0] < 0.8 and after[0] > before[0] + 0.15, (before, after)

    info: list[dict] = []
    assert _dep(ranks, tiny_v4_model, world, redundant, prompts, 6, 1, phy2log=placed.phy2log, info=info) == want

    # What the ranks ran, slot by slot ([L, P], rank 0's slots then rank 1's).
    ran = torch.tensor([sum((i["slot_tokens"][lid] for i in info), []) for lid in range(num_layers)])
    replicas = placed.phy2log[0] == hot
    assert abs(int(ran[0, replicas].max() - ran[0, replicas].min())) <= world  # dealt in turn on each rank
    ran_loads = torch.zeros(num_layers, E, dtype=torch.float64).scatter_add_(1, placed.phy2log, ran.double())
    rank_loads = ran.double().view(num_layers, world, -1).sum(-1)
    measured = rank_loads.mean(-1) / rank_loads.amax(-1)
    predicted = Placement(placed.phy2log, E, world).layer_ratios(ran_loads)
    assert torch.allclose(measured, predicted, atol=0.02), (measured, predicted)
    assert measured[0] > naive.layer_ratios(ran_loads)[0] + 0.15
    print(f"hash-skew layer ratios naive {before.tolist()} placed {after.tolist()} measured {measured.tolist()}")


def _sp(max_tokens: int):
    from moemesh.shared.protocol.messages import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
