"""What a worker knows of its own engine between steps: the load snapshot that
heartbeats and stats replies read, the step-phase metrics, and the recent steps that
`moemesh profile` asks for.

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
    (`refresh_load`). `comm_s` and `agree_s` report a DEP rank's time in expert
    collectives and in the per-step agreement (0 elsewhere); `skew_s`, where the device
    knows it (the mock), the part of that wait that was the slower ranks' own step."""

    def __init__(self, engine: LLMEngine, metrics: Metrics, gap_s: Callable[[], float],
                 comm_s: Callable[[], float], agree_s: Callable[[], float],
                 skew_s: Callable[[], float] = lambda: 0.0):
        self._engine, self._gap_s, self._comm_s, self._agree_s = engine, gap_s, comm_s, agree_s
        self._skew_s = skew_s
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
        agree = self._agree_s()
        # A DEP rank's agreement runs in the loop between two steps, so the loop gap holds
        # it too; it is rank wait, and counted in both it would be counted twice.
        gap = max(self._gap_s() - agree, 0.0)
        a = self.last_account = account(self._engine.last_stats, self._comm_s(), agree, gap)
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
                                      gap, a.num_seqs, a.exposed_s, e.last_stats.num_accepted, self._skew_s()])
        for phase, v in (("forward", a.forward_s), ("host", a.host_s), ("host_exposed", a.exposed_s),
                         ("rank_wait", a.rank_wait_s), ("total", a.total_s)):
            self.h_phase.labels(phase).observe(v)

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
