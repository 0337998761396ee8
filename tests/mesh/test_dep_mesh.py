"""A DEP2 decode instance through the whole mesh: gloo all-to-all between the two rank
processes, expert loads to the balancer, and live expert moves while streams run."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import nats
import pytest
import torch

from moemesh.shared.protocol.messages import ExpertLoad, RebalanceReply, RebalanceRequest, SamplingParams, decode
from moemesh.tools.launch.procs import free_port
from moemesh.shared.model.expert_parallel import start_phy2log
from moemesh.shared.service.dep_runtime import tensor_bytes
from moemesh.shared.service.nats_io import request
from moemesh.shared.protocol.subjects import Subjects
from tests.mesh.conftest import start_mesh

PROMPTS = [f"Expert {i} holds the tokens of rank {i % 3}" + " again" * (i % 4) for i in range(16)]
LAYERS = 3  # the tiny model: two MoE layers and the MTP layer


def _mesh(tmp, model, rank_set=None, balancer_set=()):
    metrics = free_port()
    m = start_mesh(tmp, model, decode_dp=2, rank_set=rank_set,
                   decode_set=["eplb_redundant=1", "load_publish_interval_s=0.2"],
                   balancer_set=["auto=false", f"metrics_port={metrics}", "move_timeout_s=20", *balancer_set])
    m.balancer_metrics = f"http://127.0.0.1:{metrics}/metrics"
    return m


@pytest.fixture(scope="module")
def dep_mesh(tiny_model, tmp_path_factory):
    # One layer per move: a rebalance is several whole moves, each switching one layer.
    m = _mesh(tmp_path_factory.mktemp("dep"), tiny_model, balancer_set=["layers_per_move=1"])
    yield m
    m.group.stop()


def _swap_halves() -> torch.Tensor:
    """Every expert changes rank: the largest move there is."""
    naive = start_phy2log(16, 2, 1)
    return torch.cat([naive[9:], naive[:9]]).repeat(LAYERS, 1)


def _rebalance(mesh, phy2log: torch.Tensor | None, timeout_s: float = 30) -> RebalanceReply:
    async def go():
        nc = await nats.connect(mesh.nats_url)
        try:
            req = RebalanceRequest(mesh.decode_id, tensor_bytes(phy2log) if phy2log is not None else b"",
                                   phy2log.shape[0] if phy2log is not None else 0)
            deadline = time.monotonic() + 20
            while True:
                reply = await request(nc, Subjects().eplb(mesh.decode_id, "rebalance"), req, RebalanceReply, timeout_s)
                if reply.ok or "has not reported" not in reply.error or time.monotonic() > deadline:
                    return reply
                await asyncio.sleep(0.2)
        finally:
            await nc.close()

    return asyncio.run(go())


def _placement_version(mesh) -> int:
    async def go():
        nc = await nats.connect(mesh.nats_url)
        try:
            sub = await nc.subscribe(Subjects().eplb(mesh.decode_id, "load"))
            while True:
                m = decode((await sub.next_msg(timeout=10)).data, ExpertLoad)
                if m.rank == 0:
                    return m.placement_version
        finally:
            await nc.close()

    return asyncio.run(go())


def _stream_all(mesh, prompts, max_tokens, during=None, model: str = "tiny") -> list[str]:
    """Streams every prompt concurrently; `during` runs once the streams are flowing."""
    out: list[str | None] = [None] * len(prompts)
    started = threading.Event()

    def one(i):
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text = []
        with httpx.Client(timeout=120) as c, c.stream("POST", mesh.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    import json

                    text.append(json.loads(line[6:])["choices"][0]["text"])
        out[i] = "".join(text)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    extra = None
    if during is not None:
        started.wait(60)
        extra = during()
    for t in threads:
        t.join(180)
    return out, extra


def test_dep2_serves_through_the_mesh_like_one_engine(dep_mesh, offline):
    want = [o.text for o in offline.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    got, _ = _stream_all(dep_mesh, PROMPTS, 12)
    assert got == want
    h = httpx.get(dep_mesh.url + "/health").json()
    assert h["workers"]["decode"] == 2  # each rank is a worker the gateway can place requests on


def test_balancer_reports_target_and_draft_balance(dep_mesh):
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(dep_mesh.balancer_metrics).text
        if 'model="draft"' in text or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert 'moemesh_eplb_balance_ratio{instance="decode-t",model="target",model_name=' in text
    assert 'moemesh_eplb_balance_ratio{instance="decode-t",model="draft",model_name=' in text
    assert "moemesh_eplb_layer_balance_ratio" in text


def test_live_move_mid_stream_keeps_every_output(dep_mesh, offline):
    want = [o.text for o in offline.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))]
    before = _placement_version(dep_mesh)
    got, reply = _stream_all(dep_mesh, PROMPTS, 40, during=lambda: _rebalance(dep_mesh, _swap_halves()))
    assert reply.ok, reply.error
    assert reply.slots_changed > 0 and reply.bytes_moved > 0
    assert got == want  # none failed, none changed
    assert _placement_version(dep_mesh) == before + LAYERS  # one move per layer


def test_policy_driven_rebalance(dep_mesh):
    reply = _rebalance(dep_mesh, None)
    assert reply.ok, reply.error
    assert reply.policy_seconds > 0
    r = httpx.post(dep_mesh.url + "/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200


def test_a_move_that_fails_half_way_keeps_the_old_placement(tiny_model, tmp_path_factory, offline):
    mesh = _mesh(tmp_path_factory.mktemp("depfail"), tiny_model, rank_set={1: ["debug_fail_move=true"]})
    try:
        reply = _rebalance(mesh, _swap_halves())
        assert not reply.ok and "rank 1" in reply.error and "injected" in reply.error
        assert _placement_version(mesh) == 0
        want = [o.text for o in offline.generate(PROMPTS[:4], SamplingParams(max_tokens=8, temperature=0,
                                                                             ignore_eos=True))]
        got, _ = _stream_all(mesh, PROMPTS[:4], 8)
        assert got == want
    finally:
        mesh.group.stop()


@pytest.fixture(scope="module")
def dep_both(tiny_model, tmp_path_factory):
    """A prefill instance of two expert-parallel ranks and a decode instance of two ranks
    without drafts, in one mesh (`moemesh up --prefill-dep 2 --dep 2`)."""
    from moemesh.tools.launch.up import Mesh, UpConfig

    up = UpConfig(model=tiny_model, port=0, prefill_dp=2, decode_dp=2, log_dir=str(tmp_path_factory.mktemp("pdep")),
                  balancer=False, service_args=("num_kv_blocks=256", "staging_mb=16"),
                  decode_args=("num_speculative_tokens=0",))
    with Mesh(up) as mesh:
        yield mesh


def _served_name(mesh) -> str:
    from pathlib import Path

    return Path(mesh.cfg.model).name  # `moemesh up` serves the model under its folder's name


def _complete_each(mesh, prompts, max_tokens: int) -> list[str]:
    name = _served_name(mesh)
    got = []
    for p in prompts:
        r = httpx.post(mesh.url + "/v1/completions", timeout=60, json={
            "model": name, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    return got


def test_a_dep2_prefill_instance(dep_both, offline):
    """Prefill, too, can be an instance of expert-parallel ranks."""
    assert httpx.get(dep_both.url + "/health").json()["workers"]["prefill"] == 2
    want = [o.text for o in offline.generate(PROMPTS[:6], SamplingParams(max_tokens=8, temperature=0,
                                                                         ignore_eos=True))]
    assert _complete_each(dep_both, PROMPTS[:6], 8) == want


def test_dep2_without_drafts_plans_its_steps_and_serves_like_one_engine(dep_both, offline):
    """Lockstep ranks without MTP take planned steps too (an empty one where a rank has no
    work): greedy output equals one engine's (with drafts or not, greedy is the target's)."""
    assert httpx.get(dep_both.url + "/health").json()["workers"]["decode"] == 2
    want = [o.text for o in offline.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0,
                                                                     ignore_eos=True))]
    got, _ = _stream_all(dep_both, PROMPTS, 12, model=_served_name(dep_both))
    assert got == want


def test_a_mock_dep2_instance_runs_the_real_lockstep_and_its_moves_shift_the_step(tiny_model, tmp_path_factory):
    """engine = "mock" as a DEP rank: drafts verified, the hot expert's rank sets the
    instance's pace (the slower rank's device time shows in the other's rank wait), and a
    live rebalance of the real balancer moves real slots."""
    from tests.mesh.conftest import worker_stats

    mock = ["engine=mock", "mock_step_ms=4", "num_speculative_tokens=1", "mock_accept_rate=0.7"]
    mesh = _mesh(tmp_path_factory.mktemp("mockdep"), tiny_model,
                 rank_set={r: [*mock, "skew=hot:3:5.0", "load_window_steps=32"] for r in range(2)})
    try:
        prompts = PROMPTS[:8]
        got, _ = _stream_all(mesh, prompts, 24)
        assert all(t for t in got)  # every stream finished with text
        stats = [asyncio.run(worker_stats(mesh.nats_url, f"{mesh.decode_id}-r{r}", detail=True)) for r in range(2)]
        rows = [s for st in stats for s in st.recent_steps if s[6] > 0]
        assert rows and all(len(s) == 10 for s in rows)
        assert sum(s[8] for s in rows) > 0  # drafts were accepted
        skew = [s[9] for s in rows]
        assert max(skew) > 0  # a rank waited inside the step for the other's experts
        before = _placement_version(mesh)
        reply = _rebalance(mesh, None)
        assert reply.ok, reply.error
        assert reply.bytes_moved > 0 and reply.ratio_after_expected > reply.ratio_before
        assert _placement_version(mesh) > before
        got, _ = _stream_all(mesh, prompts, 8)
        assert all(t for t in got)
    finally:
        mesh.group.stop()
