"""`moemesh bench chaos`: what the mesh does to its clients' streams when production
happens to it: a worker killed, a gateway killed, NATS down for a while, a drain that
runs out of time.

Each scenario gets a fresh local mesh of real processes (so SIGKILL is real): NATS, two
prefill and two decode workers on the mock engine, one gateway (two for kill-gateway).
Run of one scenario:
1. up: the mesh, and the load client (tools/bench/chaos_client.py) in its own process,
   with `streams` streams of `max_tokens` tokens each, at temperature 0.
2. strike: once every stream is generating (kill-prefill: once a prefill worker has a
   queue), the fault, at a time noted; the client is told, and sends probes from then.
3. watch: NATS comes back after its outage; 3 s after a gateway dies, the requests the
   workers still hold for it (the orphans) are counted.
4. collect: the client's streams (until they end or the deadline passes), the surviving
   gateways' metrics, the services' logs; then the mesh stops.
5. report: tools/bench/chaos_report.py turns that into the scenario's row.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from moemesh.tools.bench import chaos_report as report
from moemesh.tools.bench.chaos_client import ChaosLoad, LoadClient
from moemesh.tools.bench.chaos_scenarios import SCENARIOS, Scenario
from moemesh.tools.bench.env import environment
from moemesh.tools.launch.nats_server import start_nats
from moemesh.tools.launch.procs import ProcessGroup, free_port
from moemesh.tools.launch.up import Mesh, UpConfig, default_home

BLOCK_SIZE = 16
PROMPTS_PER_SLOW_STEP = 2  # kill-prefill's slowed prefill: a burst of streams queues


@dataclass(frozen=True)
class ChaosConfig:
    model: str = ""
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    streams: int = 100
    max_tokens: int = 200
    prompt_tokens: int = 64
    ready_tokens: int = 20  # every stream has this many tokens when a mid-stream fault strikes
    mock_step_ms: float = 20.0
    deadline_s: float = 30.0  # after the fault (and the outage): a stream still open then is hung
    probe_rate: float = 5.0  # new requests a second, for 5 s after the fault
    log_dir: str = ""

    def __post_init__(self) -> None:
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown or not self.scenarios:
            raise ValueError(f"unknown scenario {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
        if self.streams < 2 or self.max_tokens < 2 or self.prompt_tokens < 1:
            raise ValueError("--streams and --max-tokens must be >= 2, --prompt-tokens >= 1")
        if not 1 <= self.ready_tokens < self.max_tokens:
            raise ValueError("--ready-tokens must be in [1, max_tokens)")
        if self.mock_step_ms <= 0 or self.deadline_s <= 0 or self.probe_rate < 0:
            raise ValueError("--mock-step-ms and --deadline-s must be > 0, --probe-rate >= 0")


def run(cfg: ChaosConfig) -> dict:
    root = Path(cfg.log_dir) if cfg.log_dir else default_home() / "runs" / time.strftime("chaos-%Y%m%d-%H%M%S")
    rows = []
    for name in cfg.scenarios:
        try:
            rows.append(run_scenario(cfg, SCENARIOS[name], root / name))
        except Exception as e:  # one scenario that could not run must not cost the others
            rows.append({"scenario": name, "failed": f"{type(e).__name__}: {e}", "goal": "FAILED"})
        print(f"chaos: {name} done", file=sys.stderr)
    return {"bench": "chaos", "config": asdict(cfg), "env": environment(), "goal": report.GOALS,
            "log_dir": str(root), "scenarios": rows}


def table(r: dict) -> str:
    return report.table(r["scenarios"], r["config"])


# ---- one scenario ------------------------------------------------------------------------
def _up(cfg: ChaosConfig, sc: Scenario, log_dir: Path, nats_url: str) -> UpConfig:
    """No admission or memory limit caps the run: every stream (and every migrated one,
    whose prompt holds what it streamed) fits at once."""
    blocks = -(-(cfg.prompt_tokens + 2 * cfg.max_tokens) // BLOCK_SIZE)
    worker = ("engine=mock", f"mock_step_ms={cfg.mock_step_ms}", f"block_size={BLOCK_SIZE}",
              f"max_num_seqs={max(2 * cfg.streams, 64)}",
              f"max_num_batched_tokens={max(16384, cfg.streams * (cfg.prompt_tokens + cfg.max_tokens))}",
              f"num_kv_blocks={max(8192, 2 * cfg.streams * blocks)}")
    # A slow prefill takes two prompts a step: a burst of streams waits in its queue.
    prefill = (f"mock_step_ms={sc.prefill_step_ms}",
               f"max_num_batched_tokens={PROMPTS_PER_SLOW_STEP * cfg.prompt_tokens}") \
        if sc.prefill_step_ms else ()
    decode = (f"drain_timeout_s={sc.drain_timeout_s}",) if sc.drain_timeout_s else ()
    return UpConfig(model=cfg.model, nats_url=nats_url, port=0, num_prefill=2, num_decode=2, num_gateways=sc.gateways,
                    service_args=worker, prefill_args=prefill,
                    decode_args=decode, gateway_args=(f"max_inflight={4 * cfg.streams}", "worker_header=true"), balancer=False,
                    log_dir=str(log_dir))


def run_scenario(cfg: ChaosConfig, sc: Scenario, log_dir: Path) -> dict:
    # NATS is started here, not by the mesh: the scenario stops it and starts it again on
    # its port, and it must outlive the mesh's own stop (the workers drain through it).
    nats = ProcessGroup(log_dir)
    port = free_port()
    try:
        start_nats(nats, port)
        with Mesh(_up(cfg, sc, log_dir, f"nats://127.0.0.1:{port}")) as mesh:
            return _scenario_on(mesh, nats, port, cfg, sc, log_dir)
    finally:
        nats.stop()


def _scenario_on(mesh: Mesh, nats: ProcessGroup, port: int, cfg: ChaosConfig, sc: Scenario, log_dir: Path) -> dict:
    gateways = mesh.urls
    load = ChaosLoad(urls=gateways, model=Path(mesh.model).name, streams=cfg.streams, max_tokens=cfg.max_tokens,
                     prompt_tokens=cfg.prompt_tokens, ready_tokens=cfg.ready_tokens, probe_rate=cfg.probe_rate)
    observed: dict = {"victim_role": sc.target}
    with LoadClient(load, log_dir / "client.log") as client:
        client.wait("sent")
        if sc.target == "prefill":  # while its queue is long, before any stream has a token
            victim = _busiest(mesh, "prefill", queued=True)
        else:
            client.wait("streaming")
            victim = _busiest(mesh, "decode") if sc.target == "decode" else None
        if sc.target == "gateway":
            victim = "gateway-0"  # gateway-1 serves the other half, and the probes
            observed["orphans_at_kill"] = _orphans(mesh, victim)
        observed["victim"] = victim
        child = (nats if sc.fault == "nats" else mesh.group).live("nats" if sc.fault == "nats" else victim)
        t_fault = time.time()
        child.popen.send_signal(signal.SIGTERM if sc.fault == "term" else signal.SIGKILL)
        client.fault(t_fault, t_fault + sc.outage_s + cfg.deadline_s)
        if sc.fault == "nats":
            time.sleep(max(0.0, t_fault + sc.outage_s - time.time()))
            start_nats(nats, port)
        if sc.target == "gateway":
            time.sleep(max(0.0, t_fault + report.GOALS["orphans_after_s"] - time.time()))
            observed["orphans_after_3s"] = _orphans(mesh, victim)
        result = client.result(t_fault + sc.outage_s + cfg.deadline_s + 60 - time.time())
    observed.update(_gateway_counters(gateways[1:] if sc.target == "gateway" else gateways))
    observed.update(_from_logs(mesh, sc, victim, t_fault))
    return report.scenario_row(sc.name, result, observed, lost_gateway=0 if sc.target == "gateway" else None)


# ---- what the mesh says --------------------------------------------------------------------
def _worker_ids(mesh: Mesh, role: str) -> list[str]:
    return [c.name for c in mesh.group.children if c.name.startswith(role + "-")]


async def _stats(nc, worker_ids: list[str]) -> dict:
    from moemesh.shared.protocol.messages import StatsRequest, WorkerStats
    from moemesh.shared.protocol.subjects import Subjects
    from moemesh.shared.service.nats_io import Unreachable, request

    out = {}
    for w in worker_ids:
        try:
            out[w] = await request(nc, Subjects().stats(w), StatsRequest(), WorkerStats, 5)
        except Unreachable:
            pass  # dead: it holds nothing
    return out


async def _stats_of(nats_url: str, worker_ids: list[str]) -> dict:
    import nats

    # A cluster's URLs, comma-separated, in order: a node that is down is tried last.
    nc = await nats.connect(nats_url.split(","), dont_randomize=True)
    try:
        return await _stats(nc, worker_ids)
    finally:
        await nc.close()


def _busiest(mesh: Mesh, role: str, queued: bool = False, timeout_s: float = 20.0) -> str:
    """The worker of a role holding the most requests; queued: the first prefill worker seen
    with more prompts to compute than one step takes (its queue). Counted from what the
    service holds: the engine's load snapshot is not refreshed during a long step."""
    import nats

    async def watch() -> str:
        nc = await nats.connect(mesh.nats_url)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                stats = await _stats(nc, _worker_ids(mesh, role))
                # queued: the jobs not computed yet (num_held: those computed, waiting for their pull)
                load = {w: sum(s.requests_by_gateway.values()) - (s.num_held if queued else 0)
                        for w, s in stats.items()}
                if load and (not queued or max(load.values()) > PROMPTS_PER_SLOW_STEP):
                    return max(sorted(load), key=load.get)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {role} worker had {'a queue' if queued else 'work'} to strike")
                await asyncio.sleep(0.01)
        finally:
            await nc.close()

    return asyncio.run(watch())


def _orphans(mesh: Mesh, gateway_id: str) -> int:
    """Requests the live workers still hold for a gateway (queued, running or handed over)."""
    stats = asyncio.run(_stats_of(mesh.nats_url, _worker_ids(mesh, "prefill") + _worker_ids(mesh, "decode")))
    return sum(s.requests_by_gateway.get(gateway_id, 0) for s in stats.values())


def _gateway_counters(urls: list[str]) -> dict:
    names = {"migrations": "moemesh_request_migrations_total", "token_gaps": "moemesh_token_gaps_total",
             "token_resends": "moemesh_token_resends_total"}
    out = dict.fromkeys(names, 0.0)
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        for key, name in names.items():
            out[key] += report.metric(text, name) or 0.0
    return out


def _from_logs(mesh: Mesh, sc: Scenario, victim: str, t_fault: float) -> dict:
    """Detection time: the first log line that names the victim as suspect or gone."""
    def text(name: str) -> str:
        p = mesh.log_dir / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    if sc.target == "gateway":
        seen = [t for w in _worker_ids(mesh, "prefill") + _worker_ids(mesh, "decode")
                for t in report.log_times(text(w), f"gateway {victim} stopped sending heartbeats")]
    elif sc.target:  # suspect (no new work) or dead (its streams move), whichever the gateway logs first
        seen = [t for needle in (f"worker {victim} is suspect", f"worker {victim} stopped sending heartbeats")
                for t in report.log_times(text("gateway"), needle)]
    else:
        seen = []
    seen = [t for t in seen if t >= t_fault - 1]  # log stamps have milliseconds; the clock is shared
    return {"detected_s": max(0.0, min(seen) - t_fault) if seen else None}
