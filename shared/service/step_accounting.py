"""A worker's bookkeeping of where time went, with tracing off.

Per step (StepAccounting, the engine loop's one hook after every step): what the worker
knows of its own engine between steps, i.e. the load snapshot that heartbeats and stats
replies read, the step-phase metrics and the recent steps that `moemesh profile` asks
for; an expert-parallel rank's figures of the step (only there); and the blocks the step
cached or evicted, handed on to the KV events.

Per request (PhaseLog): a few clock readings a request, kept as a row of phase durations
for the last requests and as one Prometheus histogram labelled by phase. The rows answer
StatsRequest(detail=True) (WorkerStats.recent_requests, columns named by
WorkerStats.request_phases): `moemesh bench stream` reads them over a point's load window
and takes exact percentiles, which a histogram's buckets cannot give at a few
milliseconds. The histogram is for an operator's dashboards, with buckets fine enough to
tell one 5 ms decode step from two.

Where one engine step's time went (StepAccount):

forward: device compute (target and MTP forwards), collectives excluded. For an
      overlapped step this is the device's whole step: forward, LM head and sampling.
host: everything on the CPU around it: scheduling, batch building, sampling, draft
      bookkeeping, and the serving loop's own work (publishing tokens, applying
      requests). When the loop overlaps the host with the device, most of it runs
      beside the forward:
host_exposed: the part of host the device waited for. Without overlap, all of it.
rank_wait: time in collectives, the per-step agreement and the MoE all-to-all; on an
      expert-parallel instance that is mostly waiting for the slowest rank.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.engine.outputs import StepStats
from moemesh.shared.protocol.messages import WorkerLoad
from moemesh.shared.telemetry.metrics import Metrics

LOAD_REFRESH_S = 0.05
# 0.5 ms apart to 10 ms, 2.5 ms apart to 30 ms, then as the default latency buckets.
PHASE_BUCKETS = (*(i * 0.0005 for i in range(1, 21)), 0.0125, 0.015, 0.0175, 0.02, 0.0225, 0.025, 0.0275, 0.03,
                 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MAX_ROWS = 4096

# An expert-parallel rank's figures of the step that just ended: (comm_s, agree_s, skew_s).
RankStep = Callable[[], tuple[float, float, float]]


@dataclass(frozen=True)
class StepAccount:
    forward_s: float
    host_s: float
    rank_wait_s: float
    num_tokens: int
    num_seqs: int
    host_exposed_s: float = -1.0  # -1: same as host_s (no overlap)

    @property
    def exposed_s(self) -> float:
        return self.host_s if self.host_exposed_s < 0 else self.host_exposed_s

    @property
    def total_s(self) -> float:
        """The step's length as the device sees it."""
        return self.forward_s + self.exposed_s + self.rank_wait_s


def account(st: StepStats, comm_s: float = 0.0, agree_s: float = 0.0, gap_s: float = 0.0) -> StepAccount:
    if st.host_exposed_s is not None:  # overlapped: sampling ran on the device thread
        # A lockstep rank's collectives ran inside its device window: rank wait, not forward.
        # An MTP step's verification and draft pass ran on the device thread after its wait
        # (draft_s): host work too, and the part the next step waited for is in exposed.
        return StepAccount(forward_s=max(0.0, st.forward_s + st.sample_s - comm_s),
                           host_s=(st.loop_host_s or 0.0) + st.draft_s,
                           rank_wait_s=comm_s + agree_s, num_tokens=st.num_tokens, num_seqs=st.num_seqs,
                           host_exposed_s=st.host_exposed_s)
    model_s = st.forward_s + st.draft_s
    return StepAccount(
        forward_s=max(0.0, model_s - comm_s),
        host_s=max(0.0, st.total_s - model_s) + gap_s,
        rank_wait_s=comm_s + agree_s,
        num_tokens=st.num_tokens,
        num_seqs=st.num_seqs,
    )


class StepAccounting:
    """Called by the engine loop only: after every step (`on_step`) and after ops
    (`refresh_load`). rank_step, on an expert-parallel rank only (None elsewhere, where
    these are 0 and nothing is asked): the rank's time in expert collectives and in the
    per-step agreement, and, where the device knows it (the mock), the part of that wait
    that was the slower ranks' own step. block_events(stored, removed), once set: where
    the hashes of the blocks each step cached or evicted go (the worker's KV events)."""

    def __init__(self, engine: LLMEngine, metrics: Metrics, gap_s: Callable[[], float],
                 rank_step: RankStep | None = None):
        self._engine, self._gap_s, self._rank_step = engine, gap_s, rank_step
        self.block_events: Callable[[list[bytes], list[bytes]], None] | None = None
        self.h_phase = metrics.histogram("step_phase_seconds", "engine step time by phase", ("phase",))
        self.c_steps = metrics.counter("steps_total", "engine steps (empty lockstep steps included)")
        self.c_prompt = metrics.counter("prompt_tokens_total", "prompt tokens prefilled or reused")
        self.c_cached = metrics.counter("prefix_cache_hit_tokens_total",
                                        "prompt tokens whose KV came from the prefix cache")
        self.c_drafted = metrics.counter("spec_decode_draft_tokens_total", "MTP draft tokens proposed")
        self.c_accepted = metrics.counter("spec_decode_accepted_tokens_total",
                                          "MTP draft tokens the target model accepted")
        # Read at scrape time from the load snapshot the loop keeps anyway: nothing per step.
        metrics.gauge("num_requests_running", "requests in the running batch").set_function(
            lambda: self.load.num_running)
        metrics.gauge("num_requests_waiting", "requests admitted and waiting to run").set_function(
            lambda: self.load.num_waiting)
        metrics.gauge("kv_cache_usage_ratio", "share of KV cache blocks in use, 0 to 1").set_function(
            lambda: 1.0 - self.load.num_free_blocks / self.load.num_blocks if self.load.num_blocks else 0.0)
        self._seen_prompt = self._seen_cached = self._seen_drafted = self._seen_accepted = 0
        self.last_account: StepAccount | None = None
        self.recent_steps: deque[list[float]] = deque(maxlen=4096)
        self.load = WorkerLoad()
        self._load_at = 0.0

    def on_step(self) -> None:
        comm, agree, skew = self._rank_step() if self._rank_step is not None else (0.0, 0.0, 0.0)
        # A DEP rank's agreement runs in the loop between two steps, so the loop gap holds
        # it too; it is rank wait, and counted in both it would be counted twice.
        gap = max(self._gap_s() - agree, 0.0)
        a = self.last_account = account(self._engine.last_stats, comm, agree, gap)
        self.c_steps.inc()
        e = self._engine
        self.c_prompt.inc(e.num_prompt_tokens_total - self._seen_prompt)
        self.c_cached.inc(e.num_cached_tokens_total - self._seen_cached)
        self._seen_prompt, self._seen_cached = e.num_prompt_tokens_total, e.num_cached_tokens_total
        if e.num_drafted_total != self._seen_drafted:
            self.c_drafted.inc(e.num_drafted_total - self._seen_drafted)
            self.c_accepted.inc(e.num_accepted_total - self._seen_accepted)
            self._seen_drafted, self._seen_accepted = e.num_drafted_total, e.num_accepted_total
        if a.num_seqs:  # empty lockstep steps are waiting, not serving
            self.recent_steps.append([time.time(), a.total_s, a.forward_s, a.host_s, a.rank_wait_s,
                                      gap, a.num_seqs, a.exposed_s, e.last_stats.num_accepted, skew])
        for phase, v in (("forward", a.forward_s), ("host", a.host_s), ("host_exposed", a.exposed_s),
                         ("rank_wait", a.rank_wait_s), ("total", a.total_s)):
            self.h_phase.labels(phase).observe(v)
        if self.block_events is not None:
            self.block_events(*e.drain_kv_events())

    def refresh_load(self, force: bool = True) -> None:
        """Snapshot the engine's load. Only from the engine loop: between steps or in an op.
        Unforced, at most every LOAD_REFRESH_S: it walks every request, and heartbeats read
        it once a second; an idle loop always refreshes it (forced)."""
        now = time.monotonic()
        if not force and now - self._load_at < LOAD_REFRESH_S:
            return
        self._load_at = now
        r, w, free, total, out = self._engine.load()
        self.load = WorkerLoad(r, w, free, total, out, self._engine.pending_prompt_tokens())


class PhaseLog:
    """One worker's per-request phases, in a fixed order."""

    def __init__(self, metrics: Metrics, name: str, doc: str, phases: tuple[str, ...], max_rows: int = MAX_ROWS):
        self.phases = phases
        self.rows: deque[list[float]] = deque(maxlen=max_rows)
        hist = metrics.histogram(name, doc, ("phase",), buckets=PHASE_BUCKETS)
        self._by_phase = [hist.labels(p) for p in phases]

    def record(self, *seconds: float) -> None:
        """One request's phases, in seconds, in the order of `phases`; the row is stamped
        with the wall clock now (when its last phase ended)."""
        if len(seconds) != len(self.phases):
            raise ValueError(f"{len(self.phases)} phases {self.phases}, got {len(seconds)} durations")
        self.rows.append([time.time(), *seconds])
        for h, s in zip(self._by_phase, seconds):
            h.observe(max(s, 0.0))

    def stats_fields(self, detail: bool) -> dict:
        """Its part of a WorkerStats reply: the rows only when asked for detail."""
        return {"request_phases": list(self.phases), "recent_requests": list(self.rows) if detail else []}
