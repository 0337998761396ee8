"""`moemesh bench stream`: the host overhead of the serving path (gateway, NATS, prefill,
decode) on the mock engine, measured the same way every time.

Run: one local mesh with `engine = "mock"` (a fixed step of `mock_step_ms`, one token per
sequence per step) -> a short warm-up -> for each stream count S, the load client
(`moemesh.tools.bench.sse_client`) in its own process: S streamed chat requests back to back for
`seconds` -> per point, tokens/s against the ideal S × G × 1000 / mock_step_ms (G = 1, or
with --spec-tokens K at --accept-rate A, 1 + A + ... + A^K), CPU µs per
output token of each mesh process and of the mesh as a whole (gateway + prefill + decode
+ nats; the client apart), and the decode worker's step figures over the load window.

With --dep N the decode worker is a DEP-N instance of mock ranks (the real lockstep and
agreement; each rank's step scales with its experts' share of the routed pairs, --skew
and --draft-skew bending the routing). The ideal is then per instance, at balanced
routing: every running sequence gains its tokens each mock step. Each point adds the
instance's balance ratio (target and draft layers, over its load window at the point's
end), rank 0's rank wait and the part of it beyond the slowest rank's own step. With
--rebalance the stream counts run twice: under the naive placement, then after one live
rebalance by the balancer (a fresh load window first).

Goals: at least 94% of the ideal at every stream count with a 20 ms step; with a 1 ms
step at 256 streams, at least 45,000 tokens/s and at most 25 µs of mesh CPU per token.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nats

from moemesh.tools.bench import overhead, request_phases
from moemesh.tools.bench.env import environment
from moemesh.shared.eplb.placement import Placement
from moemesh.shared.protocol.messages import RebalanceReply, RebalanceRequest
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.nats_io import request
from moemesh.tools.launch.up import Mesh, UpConfig

GOALS = {"share_of_ideal_min": 0.94, "share_at_step_ms": 20.0,
         "fast_step_ms": 1.0, "fast_streams": 256, "fast_tokens_per_s_min": 45000.0,
         "fast_mesh_cpu_us_per_token_max": 25.0}
BLOCK_SIZE = 16
PROMPT_TOKENS_MAX = 64  # the client's chat prompt with its template stays under this


@dataclass(frozen=True)
class StreamBenchConfig:
    model: str = ""
    streams: tuple[int, ...] = (8, 64, 256)
    seconds: float = 20.0
    osl: int = 256
    mock_step_ms: float = 20.0
    warmup_s: float = 2.0
    spec_tokens: int = 0  # the mock's drafts a step (0: no draft head)
    accept_rate: float = 0.7  # each draft's chance, with spec_tokens
    dep: int = 1  # ranks of the decode instance
    skew: str = ""  # target routing skew (DEP only)
    draft_skew: str = ""  # the draft head's
    rebalance: bool = False  # run the points again after one live rebalance
    settle_s: float = 8.0  # after the rebalance: load before the points, so the window is fresh
    expert_share: float = 0.5  # mock_expert_share
    expert_placement: str = "linear"  # the instance's start-up placement (DEP only)
    trace_file: str = ""  # every service's spans go here (tracing on); "": tracing off

    def __post_init__(self) -> None:
        if not self.streams or min(self.streams) < 1:
            raise ValueError("--streams needs one or more counts >= 1")
        if self.dep < 1 or (self.dep == 1 and (self.skew or self.draft_skew or self.rebalance)):
            raise ValueError("--dep must be >= 1; --skew, --draft-skew and --rebalance need --dep 2 or more")
        if self.mock_step_ms <= 0 or self.osl < 1 or self.seconds < 0:
            raise ValueError("--mock-step-ms must be > 0, --osl >= 1, --seconds >= 0")
        overhead.draft_gain(self.spec_tokens, self.accept_rate)  # raises on draft flags out of range

    @property
    def tokens_per_step(self) -> float:
        return overhead.draft_gain(self.spec_tokens, self.accept_rate)


def worker_settings(max_streams: int, osl: int, step_ms: float, spec_tokens: int = 0,
                    accept_rate: float = 0.7) -> tuple[str, ...]:
    """Mock worker settings under which no admission or memory limit caps the run: every
    stream runs at once, and a whole wave of prompts is one prefill step. spec_tokens > 0:
    the mock drafts that many tokens a step, each accepted with accept_rate."""
    blocks_per_seq = -(-(PROMPT_TOKENS_MAX + osl + spec_tokens) // BLOCK_SIZE)
    drafts = (f"num_speculative_tokens={spec_tokens}", f"mock_accept_rate={accept_rate}") if spec_tokens else ()
    return ("engine=mock", f"mock_step_ms={step_ms}", f"block_size={BLOCK_SIZE}",
            f"max_num_seqs={max(max_streams, 64)}",
            f"max_num_batched_tokens={max(16384, max_streams * (64 + spec_tokens))}",
            f"num_kv_blocks={max(16384, 2 * max_streams * blocks_per_seq)}", *drafts)


def goal_check(row: dict, step_ms: float) -> str:
    """The goals that apply to this point: "met", "MISSED (...)", or "-" when none does."""
    missed, applies = [], False
    if step_ms == GOALS["share_at_step_ms"]:
        applies = True
        if row["share_of_ideal"] < GOALS["share_of_ideal_min"]:
            missed.append("share")
    if step_ms == GOALS["fast_step_ms"] and row["streams"] == GOALS["fast_streams"]:
        applies = True
        if row["tokens_per_s"] < GOALS["fast_tokens_per_s_min"]:
            missed.append("tok/s")
        mesh = row["cpu_us_per_token"]["mesh"]
        if mesh is None or mesh > GOALS["fast_mesh_cpu_us_per_token_max"]:
            missed.append("CPU/tok")
    if row["errors"]:
        missed.append("errors")
    if not missed:
        return "met" if applies else "-"
    return f"MISSED ({', '.join(missed)})"


def run(cfg: StreamBenchConfig) -> dict:
    top = max(cfg.streams)
    sets = worker_settings(top, cfg.osl, cfg.mock_step_ms, cfg.spec_tokens, cfg.accept_rate)
    if cfg.dep > 1:
        # A window of ~2.5 s of 20 ms steps, published twice a second: each point's own.
        sets += (f"skew={cfg.skew}", f"draft_skew={cfg.draft_skew}", f"mock_expert_share={cfg.expert_share}",
                 f"expert_placement={cfg.expert_placement}",
                 "load_window_steps=128", "load_publish_interval_s=0.5")
    up = UpConfig(model=cfg.model, port=0, decode_dp=cfg.dep, service_args=sets,
                  gateway_args=(f"max_inflight={top * 2}",), balancer=cfg.rebalance,
                  balancer_args=("auto=false", "move_timeout_s=60") if cfg.rebalance else (),
                  trace_file=cfg.trace_file)
    moves = []
    with Mesh(up) as mesh:
        model, pids = Path(mesh.model).name, overhead.mesh_pids(mesh)
        warmup = None
        if cfg.warmup_s > 0:
            warmup = overhead.run_client(mesh.url, model, min(8, top), cfg.warmup_s, min(cfg.osl, 32),
                                         cfg.mock_step_ms, chat=True)
        rows = _points(cfg, mesh, model, pids, "naive" if cfg.rebalance else "")
        if cfg.rebalance:
            moves.append(asyncio.run(_rebalance(mesh)))
            overhead.run_client(mesh.url, model, top, cfg.settle_s, cfg.osl, cfg.mock_step_ms, chat=True)
            rows += _points(cfg, mesh, model, pids, "rebalanced")
    # The first point's window: the skew as routed, for `moemesh plan --skew file:THIS`.
    loads = rows[0].get("loads") if rows else None
    return {"bench": "stream", "config": asdict(cfg), "env": environment(), "goal": GOALS,
            "warmup": warmup, "points": rows, "moves": moves, **({"loads": loads} if loads else {})}


def _points(cfg: StreamBenchConfig, mesh: Mesh, model: str, pids: dict, phase: str) -> list[dict]:
    rows = []
    for streams in cfg.streams:
        # The instance's load window is read while the load runs: at the point's end it
        # would hold the tail, when streams finish and few are left.
        ratios: dict = {}
        probe = None
        if cfg.dep > 1:
            probe = threading.Timer(0.75 * cfg.seconds,
                                    lambda: ratios.update(asyncio.run(_instance_ratios(mesh, cfg.dep))))
            probe.start()
        res = overhead.run_client(mesh.url, model, streams, cfg.seconds, cfg.osl, cfg.mock_step_ms, chat=True,
                                  pids=pids)
        if probe is not None:
            probe.join()
        steps = overhead.decode_state(mesh, cfg.dep)[1]
        ratio, loads = ratios.pop("instance", None), ratios.pop("loads", None)
        row = overhead.point_row(res, cfg.mock_step_ms, overhead.MESH_ROLES, steps, cfg.tokens_per_step, ratio)
        row["phase"], row["balance_ratios"], row["loads"] = phase, ratios, loads
        workers = [n for n in pids if overhead.role_of(n) in request_phases.ROLES]
        row["request_phases"] = request_phases.figures(asyncio.run(request_phases.fetch(mesh.nats_url, workers)),
                                                       res["started_at"], res["ended_at"], cfg.mock_step_ms)
        row["goal"] = goal_check(row, cfg.mock_step_ms)
        rows.append(row)
    return rows


async def _instance_ratios(mesh: Mesh, dep: int) -> dict:
    """The decode instance's balance ratios, target and draft apart, over its last window."""
    from moemesh.tools.bench.eplb_live import latest_loads, ratios, split_loads

    nc = await nats.connect(mesh.nats_url)
    try:
        first, loads, phy = await latest_loads(nc, Subjects(), "decode-i0", dep, time.time())
        return ratios(first, loads, phy, dep) | {"instance": Placement(phy, first.num_experts, dep).instance_ratio(loads),
                                                 "loads": split_loads(first, loads)}
    finally:
        await nc.close()


async def _rebalance(mesh: Mesh) -> dict:
    """One live rebalance of the decode instance, asked of the balancer; its reply."""
    nc = await nats.connect(mesh.nats_url)
    try:
        t0 = time.time()
        reply = await request(nc, Subjects().eplb("decode-i0", "rebalance"), RebalanceRequest("decode-i0"),
                              RebalanceReply, 120)
        return {"ok": reply.ok, "error": reply.error, "seconds": time.time() - t0,
                "move_s": reply.move_seconds, "bytes_moved": reply.bytes_moved,
                "slots_changed": reply.slots_changed, "ratio_in_window_before": reply.ratio_before,
                "ratio_in_window_expected": reply.ratio_after_expected}
    finally:
        await nc.close()


def table(r: dict) -> str:
    c = r["config"]
    drafts = c.get("spec_tokens", 0)
    mtp = f", {drafts} drafts a step at accept rate {c['accept_rate']:g}" if drafts else ""
    dep = ""
    if c.get("dep", 1) > 1:
        dep = (f", DEP{c['dep']} (skew {c['skew'] or 'none'}, draft {c['draft_skew'] or 'none'}, "
               f"placement {c.get('expert_placement', 'linear')})")
    trace = ", tracing on" if c.get("trace_file") else ""
    head = (f"mock step {c['mock_step_ms']} ms{mtp}{dep}{trace}, osl {c['osl']}, {c['seconds']:g} s per point; "
            f"CPU us per output token of each process (gw+pre+dec+nats = mesh), client apart")
    out = [head]
    for phase in dict.fromkeys(p.get("phase", "") for p in r["points"]):
        pts = [p for p in r["points"] if p.get("phase", "") == phase]
        if phase:
            out.append(f"-- {phase}: balance ratio target/draft "
                       + ", ".join(_ratio_pair(p) for p in pts))
        out.append(overhead.table(pts, overhead.MESH_ROLES, "streams", extra="goal"))
        out.append(phase_table(pts, c["mock_step_ms"]))
    for m in r.get("moves", []):
        out.append(f"rebalance: {'ok' if m['ok'] else 'FAILED ' + m['error']}, {m['seconds']:.2f} s, move "
                   f"{m['move_s']:.3f} s, {m['bytes_moved'] / 1e6:.2f} MB, {m['slots_changed']} slots; in-window "
                   f"ratio {m['ratio_in_window_before']:.3f} -> {m['ratio_in_window_expected']:.3f} expected")
    return "\n".join(out)


def phase_table(points: list[dict], step_ms: float) -> str:
    """Where the first two tokens' time went, per point, p50/p90 ms: on the prefill worker
    (queue, prefill; the rest of TTFT is the gateway, NATS and the client), then the
    hand-off to the decode worker (dispatch, transfer, import: the second token's wait
    beyond one decode step) and its first decode step. Decode host p99: all host work of a
    step / the part the step waited for."""
    q = request_phases.p50_p90
    lines = [f"{'streams':>7} {'TTFT':>6} {'queue':>10} {'prefill':>10} {'dispatch':>10} {'transfer':>10} "
             f"{'import':>10} {'1st step':>10} {'hand-off ms':>12} {'steps':>9} {'host p99':>10}"]
    for p in points:
        ph = p.get("request_phases") or {}
        pre, dec = ph.get("prefill", {}), ph.get("decode", {})
        st = p["decode_steps"]
        lines.append(f"{p['streams']:>7} {_f(p['ttft_ms_p50']):>6} {q(pre.get('queue')):>10} "
                     f"{q(pre.get('prefill')):>10} {q(dec.get('dispatch')):>10} {q(dec.get('transfer')):>10} "
                     f"{q(dec.get('import')):>10} {q(dec.get('first_step')):>10} {q(dec.get('handoff')):>12} "
                     f"{q(dec.get('handoff_steps')):>9} "
                     f"{_f(st.get('host_ms_p99'), '.2f') + '/' + _f(st.get('host_exposed_ms_p99'), '.2f'):>10}")
    return f"request phases (p50/p90 ms; hand-off in {step_ms:g} ms steps):\n" + "\n".join(lines)


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio_pair(p: dict) -> str:
    r = p.get("balance_ratios") or {}
    return "/".join(f"{r[k]:.3f}" if k in r else "-" for k in ("target", "draft"))
