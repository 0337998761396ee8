"""DeepSeek-V4 on a DEP2 decode instance through the whole mesh: hash-routed layers and
the MTP layer go through the all-to-all, the balancer sees every MoE layer with the
draft apart, and a live expert move under V4 traffic changes no output.

The checkpoint is the upstream layout with FP8/FP4 storage: ranks dequantize experts
as they load them, so a move must carry the weights the ranks compute with."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats
import pytest
import torch

from moemesh.shared.model.expert_parallel import start_phy2log
from moemesh.shared.protocol.messages import ExpertLoad, SamplingParams, decode
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.dep_runtime import tensor_from
from tests.mesh.test_dep_mesh import PROMPTS, _mesh, _placement_version, _rebalance, _stream_all

EXPERTS, RANKS, REDUNDANT = 8, 2, 1
LAYERS = 5  # v4-tiny: four MoE layers (the first two hash-routed) and the MTP layer


@pytest.fixture(scope="module")
def v4_quantized(tmp_path_factory) -> str:
    from moemesh.shared.checkpoint.writer import init_model

    return str(init_model(tmp_path_factory.mktemp("v4-fp8"), "v4-tiny", seed=0, layout="upstream", quantize=True))


@pytest.fixture(scope="module")
def v4_offline(v4_quantized):
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.llm import LLM

    return LLM(EngineConfig(model=v4_quantized, num_kv_blocks=256))


@pytest.fixture(scope="module")
def v4_dep_mesh(v4_quantized, tmp_path_factory):
    m = _mesh(tmp_path_factory.mktemp("v4-dep"), v4_quantized, balancer_set=["layers_per_move=1"])
    yield m
    m.group.stop()


def _want(offline, prompts, max_tokens) -> list[str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.text for o in offline.generate(prompts, params)]


def _swap_halves() -> torch.Tensor:
    """Every expert changes rank, in every layer: hash, learned and MTP."""
    naive = start_phy2log(EXPERTS, RANKS, REDUNDANT)
    S = naive.numel() // RANKS
    return torch.cat([naive[S:], naive[:S]]).repeat(LAYERS, 1)


def _loads(mesh) -> dict[int, ExpertLoad]:
    """One load report from each rank."""
    async def go():
        nc = await nats.connect(mesh.nats_url)
        try:
            sub = await nc.subscribe(Subjects().eplb(mesh.decode_id, "load"))
            got: dict[int, ExpertLoad] = {}
            while len(got) < RANKS:
                m = decode((await sub.next_msg(timeout=10)).data, ExpertLoad)
                got[m.rank] = m
            return got
        finally:
            await nc.close()

    return asyncio.run(go())


def test_v4_dep2_serves_through_the_mesh_like_one_engine(v4_dep_mesh, v4_offline):
    got, _ = _stream_all(v4_dep_mesh, PROMPTS, 12)
    assert got == _want(v4_offline, PROMPTS, 12)
    assert httpx.get(v4_dep_mesh.url + "/health").json()["workers"]["decode"] == 2


def test_ranks_report_every_v4_moe_layer_and_the_balancer_the_draft_apart(v4_dep_mesh):
    _stream_all(v4_dep_mesh, PROMPTS[:2], 4)  # its own traffic: the test may run on a mesh nothing used yet
    reports = _loads(v4_dep_mesh)
    m = reports[0]
    assert list(m.layer_ids) == list(range(LAYERS)) and m.num_target_layers == LAYERS - 1
    total = sum(tensor_from(r.counts, len(r.layer_ids)) for r in reports.values())  # [L, E]
    assert bool((total.sum(1) > 0).all()), total  # hash layers 0-1, learned 2-3, MTP 4 all counted
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(v4_dep_mesh.balancer_metrics).text
        if 'model="draft"' in text or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    for which in ("target", "draft"):
        assert f'moemesh_eplb_balance_ratio{{instance="decode-t",model="{which}",model_name=' in text
    for layer in range(LAYERS):
        assert f'moemesh_eplb_layer_balance_ratio{{instance="decode-t",layer="{layer}",model_name=' in text


def test_live_move_under_v4_traffic_keeps_every_output(v4_dep_mesh, v4_offline):
    want = _want(v4_offline, PROMPTS, 40)
    before = _placement_version(v4_dep_mesh)
    got, reply = _stream_all(v4_dep_mesh, PROMPTS, 40, during=lambda: _rebalance(v4_dep_mesh, _swap_halves()))
    assert reply.ok, reply.error
    assert reply.slots_changed == LAYERS * EXPERTS + LAYERS * RANKS * REDUNDANT and reply.bytes_moved > 0
    assert got == want  # none failed, none changed
    assert _placement_version(v4_dep_mesh) == before + LAYERS  # one move per layer
    print(f"v4 live move: {reply.move_seconds:.3f}s for {LAYERS} layers, {reply.slots_changed} slots, "
          f"{reply.bytes_moved} bytes")
    # And after it, with the experts on the other ranks, still the same outputs.
    got, _ = _stream_all(v4_dep_mesh, PROMPTS[:6], 12)
    assert got == _want(v4_offline, PROMPTS[:6], 12)


def test_policy_driven_rebalance_on_v4(v4_dep_mesh):
    _stream_all(v4_dep_mesh, PROMPTS, 16)  # fresh loads in the window
    reply = _rebalance(v4_dep_mesh, None)
    assert reply.ok, reply.error
    assert reply.ratio_after_expected >= reply.ratio_before - 1e-9
    print(f"v4 policy rebalance: ratio {reply.ratio_before:.4f} -> expected {reply.ratio_after_expected:.4f}, "
          f"policy {reply.policy_seconds * 1e3:.1f} ms, move {reply.move_seconds:.3f}s")
