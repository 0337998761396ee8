"""A real mesh for end-to-end tests: nats-server on a free port, and the gateway,
prefill and decode services as separate processes, exactly as `moemesh up` runs them."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from moemesh.tools.launch.nats_server import start_nats
from moemesh.tools.launch.procs import ProcessGroup, free_port


@dataclass
class RunningMesh:
    url: str
    nats_url: str
    model: str
    trace_file: Path
    group: ProcessGroup
    prefix: str = "mm"
    prefill_id: str = "prefill-t"
    decode_id: str = "decode-t"
    gateway_id: str = "gw-t"
    process_of: dict = field(default_factory=dict)  # prefill worker id -> its process's name in group


def _wait_ready(url: str, group: ProcessGroup, timeout: float = 120, min_decode: int = 1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in group.dead():
            raise RuntimeError(f"{c.name} died during start-up:\n{c.log_tail(40)}")
        try:
            with urllib.request.urlopen(url + "/health/ready", timeout=2) as r:
                h = json.loads(r.read())
                if r.status == 200 and h["ready"] and h["workers"]["decode"] >= min_decode:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("mesh did not become ready")


def start_mesh(tmp: Path, model: str, prefill_set=(), decode_set=(), gateway_set=(), decode_dp: int = 1,
               rank_set: dict[int, list[str]] | None = None, balancer_set=None, num_prefill: int = 1,
               kv_store_set=None) -> RunningMesh:
    """decode_dp > 1 makes the decode side one DEP instance ("decode-t") of that many rank
    processes; rank_set adds settings to single ranks; balancer_set starts a balancer."""
    group = ProcessGroup(tmp / "logs")
    port = free_port()
    start_nats(group, port)
    nats_url = f"nats://127.0.0.1:{port}"
    trace = tmp / "trace.jsonl"
    http = free_port()
    m = RunningMesh(f"http://127.0.0.1:{http}", nats_url, model, trace, group)
    common = ["--model", model, "--nats-url", nats_url, "--trace-file", str(trace), "--served-model-name", "tiny",
              "--set", "num_kv_blocks=256", "--set", "staging_mb=16"]
    py = [sys.executable, "-m"]

    def sets(items):
        return [a for s in items for a in ("--set", s)]

    try:
        for i in range(num_prefill):
            wid = m.prefill_id if i == 0 else f"{m.prefill_id}{i}"
            m.process_of[wid] = f"prefill{i or ''}"
            group.start(m.process_of[wid], py + ["moemesh.services.prefill", *common, "--worker-id", wid, *sets(prefill_set)])
        if kv_store_set is not None:
            group.start("kv_store", py + ["moemesh.services.kv_store", "--nats-url", nats_url, "--worker-id", "kv-store-t",
                                          *sets(kv_store_set)])
        if decode_dp == 1:
            group.start("decode", py + ["moemesh.services.decode", *common, "--worker-id", m.decode_id, *sets(decode_set)])
        else:
            init = f"tcp://127.0.0.1:{free_port()}"
            for r in range(decode_dp):
                dep = [f"dp_size={decode_dp}", f"dp_rank={r}", f"instance_id={m.decode_id}", f"dist_init={init}",
                       "expert_parallel=true", *(rank_set or {}).get(r, [])]
                group.start(f"decode-r{r}", py + ["moemesh.services.decode", *common, "--worker-id", f"{m.decode_id}-r{r}",
                                                  *sets(decode_set), *sets(dep)])
        if balancer_set is not None:
            group.start("balancer", py + ["moemesh.services.balancer", "--model", model, "--nats-url", nats_url,
                                          *sets(balancer_set)])
        group.start("gateway", py + ["moemesh.services.gateway", "--model", model, "--nats-url", nats_url,
                                     "--trace-file", str(trace), "--port", str(http), "--worker-id", m.gateway_id,
                                     "--served-model-name", "tiny",
                                     *sets(gateway_set)])
        _wait_ready(m.url, group, min_decode=decode_dp)
    except BaseException:
        group.stop()
        raise
    return m


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("mesh"), tiny_model)
    yield m
    m.group.stop()


def kill_prefill(mesh, worker_id: str, timeout: float = 10.0) -> None:
    """SIGKILL prefill worker `worker_id` and wait until the gateway counts one prefill
    worker."""
    import signal

    import httpx

    name = mesh.process_of[worker_id]
    next(c for c in mesh.group.children if c.name == name).popen.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while httpx.get(mesh.url + "/health").json()["workers"]["prefill"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def wait_free(mesh, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pre = asyncio.run(worker_stats(mesh.nats_url, mesh.prefill_id))
        dec = asyncio.run(worker_stats(mesh.nats_url, mesh.decode_id))
        if (pre.load.num_free_blocks == pre.load.num_blocks and dec.load.num_free_blocks == dec.load.num_blocks
                and pre.num_held == 0 and dec.num_transfers == 0 and pre.staging_bytes_used == 0
                and dec.staging_bytes_used == 0):
            return
        assert time.monotonic() < deadline, (pre, dec)
        time.sleep(0.2)


async def worker_stats(nats_url: str, worker_id: str, prefix: str = "mm", detail: bool = False):
    import nats

    from moemesh.shared.protocol.messages import StatsRequest, WorkerStats
    from moemesh.shared.protocol.subjects import Subjects
    from moemesh.shared.service.nats_io import request

    nc = await nats.connect(nats_url)
    try:
        return await request(nc, Subjects(prefix).stats(worker_id), StatsRequest(detail=detail), WorkerStats, 5)
    finally:
        await nc.close()
