"""Failure paths: a KV transfer that fails, a worker that dies, a worker told to stop."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import signal
import time

import httpx
import pytest

from moemesh.services.gateway.mesh.client import CLIENT_ERROR
from moemesh.shared.protocol.messages import SamplingParams
from tests.mesh.conftest import start_mesh


async def _next_beat(nats_url: str, worker_id: str):
    import nats

    from moemesh.shared.protocol.messages import Heartbeat, decode
    from moemesh.shared.protocol.subjects import Subjects

    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe(Subjects().heartbeat("decode", worker_id))
        return decode((await sub.next_msg(timeout=10)).data, Heartbeat)
    finally:
        await nc.close()


@pytest.fixture(scope="module", params=["recompute", "fail"])
def fault_mesh(request, tiny_model, tmp_path_factory):
    # The prefill worker acknowledges every pull but never sends the bytes, so every
    # transfer times out on the decode side.
    m = start_mesh(tmp_path_factory.mktemp("faults"), tiny_model,
                   prefill_set=["debug_kv_fault=drop"],
                   decode_set=["transfer_timeout_s=1.0", f"on_transfer_failure={request.param}"],
                   gateway_set=["max_inflight=2", "admission_queue=0"])  # full means 429 at once
    m.mode = request.param
    yield m
    m.group.stop()


def test_failed_transfer_takes_the_documented_path(fault_mesh, offline):
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    r = httpx.post(fault_mesh.url + "/v1/completions", json=body, timeout=30)
    took = time.monotonic() - t0
    assert took < 10  # nothing hangs: the 1 s transfer timeout decides
    if fault_mesh.mode == "recompute":
        want = offline.generate(["Hello world"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
    else:
        # The client hears that it failed; the worker's account (subjects, workers) is logged.
        assert r.status_code == 500 and r.json()["error"]["message"] == CLIENT_ERROR
    # The decode worker's beats say its hand-offs fail: gateways send new work elsewhere first.
    beat = asyncio.run(_next_beat(fault_mesh.nats_url, fault_mesh.decode_id))
    assert beat.handoffs_failing
    from tests.mesh.conftest import wait_free

    wait_free(fault_mesh)
    metrics = httpx.get(fault_mesh.url + "/metrics").text
    assert "moemesh_requests_total" in metrics


def test_admission_full_gives_429_with_retry_after(fault_mesh):
    import threading

    body = {"model": "tiny", "prompt": "slow", "max_tokens": 4, "ignore_eos": True}  # an early EOS would skip the transfer
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        httpx.post(fault_mesh.url + "/v1/completions", json=body, timeout=30).status_code)) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5  # each transfer takes its 1 s timeout, so both stay in flight
    while httpx.get(fault_mesh.url + "/health").json()["inflight"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = httpx.post(fault_mesh.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    for t in threads:
        t.join()
    assert len(results) == 2


def test_sigterm_drains_in_flight_work_then_exits(fault_mesh):
    if fault_mesh.mode != "recompute":
        pytest.skip("one mesh is enough for this")
    decode = next(c for c in fault_mesh.group.children if c.name == "decode")
    body = {"model": "tiny", "prompt": "drain me", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", fault_mesh.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        decode.popen.send_signal(signal.SIGTERM)
        rest = [l for l in lines if l]
    assert rest[-1] == "data: [DONE]"
    assert any('"finish_reason":"length"' in l for l in rest)
    decode.popen.wait(30)
    assert decode.popen.returncode == 0


def test_gateway_forgets_a_dead_worker_within_seconds(fault_mesh):
    if fault_mesh.mode != "fail":
        pytest.skip("one mesh is enough for this")
    decode = next(c for c in fault_mesh.group.children if c.name == "decode")
    decode.popen.kill()
    t0 = time.monotonic()
    while httpx.get(fault_mesh.url + "/health").json()["workers"]["decode"] != 0:
        assert time.monotonic() - t0 < 6, "dead decode worker still listed"
        time.sleep(0.2)
    r = httpx.post(fault_mesh.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
    assert r.status_code == 503 and r.headers["Retry-After"] and r.json()["error"]["code"] == "no_workers"
    assert httpx.get(fault_mesh.url + "/health/ready").status_code == 503


def test_a_prefill_worker_busy_with_a_long_step_still_takes_new_jobs(tiny_model, tmp_path_factory):
    # Each prefill step takes 3 s; the gateway waits 1 s for a worker to take a job. A
    # second request arriving mid-step must be taken at once and run after the step,
    # not refused with a 503 because the engine was busy.
    m = start_mesh(tmp_path_factory.mktemp("busy"), tiny_model,
                   prefill_set=["engine=mock", "mock_step_ms=3000"], decode_set=["engine=mock", "mock_step_ms=5"],
                   gateway_set=["prefill_timeout_s=1.0"])
    try:
        body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 2, "ignore_eos": True}
        with httpx.Client(timeout=60) as c, cf.ThreadPoolExecutor(2) as pool:
            first = pool.submit(c.post, m.url + "/v1/completions", json=body)
            time.sleep(1.0)  # the first request's step is under way
            second = pool.submit(c.post, m.url + "/v1/completions", json=body)
            codes = [first.result().status_code, second.result().status_code]
        assert codes == [200, 200], [first.result().text, second.result().text]
    finally:
        m.group.stop()
