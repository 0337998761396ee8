"""An engine worker (prefill or decode), composed of named parts.

The parts, in the order they are entered on an AsyncExitStack (and closed in reverse):

 1. tracing: the worker's tracer provider (shut down last, after everything that traces);
 2. engine: given, the mock, or built (a DEP rank joins its process group here);
 3. transport: a KVTransport from the factory the service was given (UCX by default);
 4. staging: the transfer staging memory;
 5. bus: the NATS connection (drained when closing);
 6. dep: the expert-parallel side of a rank (closing it leaves the process group);
 7. tasks: the worker's background tasks (cancelled and awaited when closing);
 8. engine loop: running (a DEP rank stops it together with the other ranks);
 9. stats replies, DEP and KV sharing subscriptions;
10. metrics server (/metrics, /health), when metrics_port >= 0;
11. heartbeats (the first thing to stop: the mesh stops routing here).

Each part is handed what it uses (the connection, the engine, the loop, a callback), not
this object. The service built on top uses the parts through it.

Also here, each in its own section after WorkerRuntime:

- step accounting: StepAccounting, the engine loop's one hook after every step, which the
  runtime makes and owns (the load snapshot, the step-phase metrics, the recent steps);
  StepAccount, where one step's time went; PhaseLog, the per-request phase rows a service
  keeps (prefill and decode each make their own);
- token publishing: TokenPublisher, which the runtime makes and owns (one TokenBatch per
  gateway per step, kept a while so that what a gateway missed can be sent again), and
  `rows` and `end_fields`, which read a step's outputs for it and for the decode service;
- Tombstones, the aborts a worker remembers for a while (each service keeps its own).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Callable

from nats.aio.client import Client as NATS

from moemesh.shared.config.common import WorkerConfig
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.engine.mock_model import MockModel
from moemesh.shared.engine.outputs import Finished, StepOutputs, StepStats
from moemesh.shared.kv.spec import KVSpec, describe
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.protocol.messages import (
    Heartbeat, PromptLogprobs, StatsRequest, TokenBatch, TokenEnd, TokenLogprob, TokenResend, WorkerLoad,
    WorkerStats, encode,
)
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.dep_runtime import DepRuntime
from moemesh.shared.service.engine_loop import EngineLoop, OutputSink
from moemesh.shared.service.heartbeat import Heartbeater
from moemesh.shared.service.kv_sharing import KVParts, KVSharing
from moemesh.shared.service.metrics_http import MetricsServer
from moemesh.shared.service.parts import Bus, TransportFactory, opened, running, tracing, ucx_transport
from moemesh.shared.service.tasks import TaskSet
from moemesh.shared.telemetry.metrics import Metrics
from moemesh.shared.telemetry.tracing import get_tracer
from moemesh.shared.transport.base import KVTransport
from moemesh.shared.transport.staging import StagingPool

log = logging.getLogger(__name__)

# How long one failed hand-off keeps a worker out of first choice. Once it gets no new
# hand-offs, none fail: after this it gets them again, so a healed data plane is used
# again and a cut one costs one more transfer timeout every HANDOFF_TROUBLE_S.
HANDOFF_TROUBLE_S = 10.0
ABORT_MEMORY_S = 60.0  # longer than any hand-off may take (lease and transfer timeouts)
MAX_REMEMBERED = 100_000  # a flood of aborts costs bounded memory; the oldest are forgotten first


class WorkerRuntime:
    def __init__(self, cfg: WorkerConfig, role: str, on_outputs: OutputSink, engine: LLMEngine | None = None,
                 transport: TransportFactory | None = None, extra_stats: Callable[[bool], dict] = lambda detail: {}):
        """on_outputs: the service's handler of every step's outputs. engine: one built
        already (tests), else made from cfg. transport: makes this worker's KVTransport
        (default UCX). extra_stats(detail): the service's fields of its stats replies."""
        self.cfg = cfg
        self.role = role
        self.worker_id = cfg.worker_id
        self.subjects = Subjects(cfg.subject_prefix)
        self.metrics = Metrics(const_labels={"model_name": cfg.model_name})
        self.draining = False
        self.leaving = False  # the engine loop failed: its last beat says so, and the service exits
        self._failure: asyncio.Future | None = None
        self._handoff_failed_at = -1e9  # monotonic
        self._started_at = time.time()
        self._on_outputs = on_outputs
        self._given_engine = engine
        self._make_transport = transport or ucx_transport(cfg)
        self._extra_stats = extra_stats
        self.tasks = TaskSet()
        self.dep = DepRuntime(cfg, role)
        self.bus = Bus(cfg, f"moemesh-{role}-{cfg.worker_id}", self.subjects, self.tasks)
        self.tracer_provider = self.tracer = None
        self.engine: LLMEngine | None = None
        self.transport: KVTransport | None = None
        self.staging: StagingPool | None = None
        self.loop: EngineLoop | None = None
        self.tokens: TokenPublisher | None = None
        self.steps: StepAccounting | None = None
        self.kv_sharing: KVSharing | None = None
        self.heartbeat: Heartbeater | None = None
        self.metrics_server: MetricsServer | None = None
        self._stack: AsyncExitStack | None = None

    @property
    def nc(self) -> NATS | None:
        return self.bus.nc

    @property
    def last_account(self) -> StepAccount | None:
        return self.steps.last_account if self.steps is not None else None

    async def start(self) -> None:
        """Enter the parts in order; on a failure half-way, what was entered is closed."""
        async with AsyncExitStack() as stack:
            await self._enter(stack)
            self._stack = stack.pop_all()

    async def _enter(self, stack: AsyncExitStack) -> None:
        cfg = self.cfg
        self.tracer_provider = await stack.enter_async_context(
            tracing(f"moemesh-{self.role}", cfg.trace_file, cfg.otlp_endpoint))
        self.tracer = get_tracer(self.tracer_provider, f"moemesh.{self.role}")
        stack.callback(self.dep.close)  # a rank that joined its group and then failed leaves it
        self.engine = await self._build_engine()
        self.kv_spec: KVSpec = describe(self.engine)
        self.transport = await stack.enter_async_context(opened(self._make_transport()))
        self.staging = StagingPool(cfg.staging_mb << 20, "cpu")
        self.dep.attach(self.engine, self.transport, self.staging)
        await stack.enter_async_context(self.bus)
        stack.callback(self.dep.close)  # after the tasks stop, before NATS goes (a no-op the second time)
        # After the tasks stop, which may still give the engine blocks back on its step thread.
        stack.callback(lambda: self.loop is not None and self.loop.shutdown())
        await stack.enter_async_context(self.tasks)
        self.tokens = TokenPublisher(self.nc, self.subjects, self.worker_id, cfg.token_retention_s)
        self.loop = loop = EngineLoop(self.engine, self._on_outputs, lockstep=self.dep.lockstep)
        self.steps = StepAccounting(self.engine, self.metrics, lambda: loop.last_gap_s,
                                    self.dep.on_step if self.dep.expert_parallel else None)
        loop.after_ops = self.steps.refresh_load
        loop.after_step = self.steps.on_step
        self.steps.refresh_load()
        self._failure = asyncio.get_running_loop().create_future()
        engine_task = await stack.enter_async_context(running(loop, cfg.dp_timeout_s + 5))
        engine_task.add_done_callback(self._on_engine_end)
        await self.bus.sub(self.subjects.stats(self.worker_id), StatsRequest, self._on_stats)
        await self.bus.sub(self.subjects.token_resend(self.worker_id), TokenResend,
                           lambda r, msg, ctx: self.tokens.resend(r))
        await self.dep.start(self.bus, loop, self.tasks.spawn)
        self.kv_sharing = KVSharing(KVParts(cfg, self.role, self.engine, self.kv_spec, loop, self.bus,
                                            self.transport, self.staging, self.tasks), self.metrics)
        self.steps.block_events = self.kv_sharing.events.add
        await self.kv_sharing.start()
        if cfg.metrics_port >= 0:
            self.metrics_server = await stack.enter_async_context(MetricsServer(
                self.metrics, lambda: {"status": "ok", "role": self.role, "draining": self.draining},
                cfg.metrics_host, cfg.metrics_port))
        self.heartbeat = await stack.enter_async_context(
            Heartbeater(self.nc, self.subjects, self._beat, cfg.heartbeat_interval_s))

    async def _build_engine(self) -> LLMEngine:
        cfg = self.cfg
        if self._given_engine is not None:
            return self._given_engine
        if cfg.engine == "mock":
            log.warning("MOCK ENGINE: %s runs no model; tokens are fabricated every %.1f ms. For infrastructure "
                        "benchmarks only.", self.worker_id, cfg.mock_step_ms)
        if cfg.uses_ep:  # the mock too: its ranks run the real lockstep (shared/engine/mock_model.py)
            return await asyncio.to_thread(self.dep.build_engine, self.role)
        if cfg.engine == "mock":
            accept = cfg.mock_accept_rate if cfg.mock_accept_rate >= 0 else None
            mock = MockModel(ModelConfig.from_dir(cfg.model), cfg.mock_step_ms / 1e3, accept,
                             max_model_len=cfg.max_model_len)
            return LLMEngine(EngineConfig.for_worker(cfg, self.role), model=mock)
        return await asyncio.to_thread(LLMEngine, EngineConfig.for_worker(cfg, self.role))

    async def close(self) -> None:
        """Leave the parts in reverse order; safe to call twice."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def __aenter__(self) -> "WorkerRuntime":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def spawn(self, coro, name: str) -> asyncio.Task:
        return self.tasks.spawn(coro, name)

    def handoff_failed(self) -> None:
        """A hand-off's transfer to this worker failed: its beats say so for HANDOFF_TROUBLE_S
        (the first at once), and new requests go to other workers first meanwhile."""
        was = time.monotonic() - self._handoff_failed_at < HANDOFF_TROUBLE_S
        self._handoff_failed_at = time.monotonic()
        if not was and self.heartbeat is not None:
            self.tasks.spawn(self.heartbeat.publish_now(), "beat-handoffs-failing")

    async def failed(self) -> str:
        """Returns (why) once this worker can no longer serve: its engine loop ended with an
        error (a DEP rank whose peer died: the collective failed, or timed out). By then its
        last beat has told the mesh it is leaving; the service exits without a drain."""
        while self._failure is None:  # before start() got that far
            await asyncio.sleep(0.1)
        return await asyncio.shield(self._failure)

    def _on_engine_end(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None or self._failure.done():
            return  # stopped with the service
        e = task.exception()
        why = f"its engine loop failed: {type(e).__name__}: {e}"
        if self.tasks.spawn(self._leave(why), "leave") is None:
            self._failure.set_result(why)  # closing anyway

    async def _leave(self, why: str) -> None:
        log.error("%s cannot serve any more (%s): leaving the mesh without a drain", self.worker_id, why)
        self.leaving = True
        try:
            if self.heartbeat is not None:
                await self.heartbeat.stop()
                await self.heartbeat.publish_now()
                await asyncio.wait_for(self.nc.flush(), 2.0)
        except Exception as e:  # NATS down too: the gateway hears of it by the missed beats
            log.warning("the leaving beat may not have gone out: %s", e)
        finally:
            self._failure.set_result(why)

    async def sub(self, subject: str, cls, handler, queue: str = "", concurrent: bool = False):
        return await self.bus.sub(subject, cls, handler, queue, concurrent)

    def _beat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id, role=self.role, model=self.cfg.model_name, load=self.steps.load,
            address=self.transport.address, draining=self.draining, leaving=self.leaving,
            handoffs_failing=time.monotonic() - self._handoff_failed_at < HANDOFF_TROUBLE_S,
            started_at=self._started_at,
            instance_id=self.cfg.instance,
            dp_rank=self.cfg.dp_rank, dp_size=self.cfg.dp_size, engine=self.cfg.engine,
            kv_identity=self.kv_spec.identity if self.engine.cfg.enable_prefix_caching else b"",
            block_size=self.engine.cfg.block_size,
        )

    async def _on_stats(self, req: StatsRequest, msg, ctx) -> WorkerStats:
        # The snapshot taken after every step and every op: exact when idle, and never
        # stuck behind a long step (a prefill of a long prompt can take seconds).
        steps = list(self.steps.recent_steps) if req.detail else []
        e = self.engine
        counters = {"prompt_tokens": float(e.num_prompt_tokens_total),
                    "prefix_cache_hit_tokens": float(e.num_cached_tokens_total),
                    "kv_pulled_tokens": float(self.kv_sharing.pulled_tokens if self.kv_sharing else 0),
                    "kv_pulls_failed": float(self.kv_sharing.pulls_failed if self.kv_sharing else 0),
                    "kv_pull_wait_max_s": self.kv_sharing.pull_wait_max_s if self.kv_sharing else 0.0}
        return WorkerStats(self.worker_id, self.role, self.steps.load, staging_bytes_used=self.staging.bytes_used,
                           recent_steps=steps, placement_version=self.dep.placement_version, counters=counters,
                           **self._extra_stats(req.detail))

    async def begin_drain(self, job_subs) -> None:
        """Stop taking new work and tell the mesh so, at once."""
        self.draining = True
        for s in job_subs:
            try:
                await s.unsubscribe()
            except Exception:
                pass
        await self.heartbeat.publish_now()


# ---- step accounting: a worker's bookkeeping of where time went, with tracing off --------
# Per step (StepAccounting, the engine loop's one hook after every step): what the worker
# knows of its own engine between steps, i.e. the load snapshot that heartbeats and stats
# replies read, the step-phase metrics and the recent steps that `moemesh profile` asks
# for; an expert-parallel rank's figures of the step (only there); and the blocks the step
# cached or evicted, handed on to the KV events.
#
# Per request (PhaseLog): a few clock readings a request, kept as a row of phase durations
# for the last requests and as one Prometheus histogram labelled by phase. The rows answer
# StatsRequest(detail=True) (WorkerStats.recent_requests, columns named by
# WorkerStats.request_phases): `moemesh bench stream` reads them over a point's load window
# and takes exact percentiles, which a histogram's buckets cannot give at a few
# milliseconds. The histogram is for an operator's dashboards, with buckets fine enough to
# tell one 5 ms decode step from two.

LOAD_REFRESH_S = 0.05
# 0.5 ms apart to 10 ms, 2.5 ms apart to 30 ms, then as the default latency buckets.
PHASE_BUCKETS = (*(i * 0.0005 for i in range(1, 21)), 0.0125, 0.015, 0.0175, 0.02, 0.0225, 0.025, 0.0275, 0.03,
                 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MAX_ROWS = 4096

# An expert-parallel rank's figures of the step that just ended: (comm_s, agree_s, skew_s).
RankStep = Callable[[], tuple[float, float, float]]


@dataclass(frozen=True)
class StepAccount:
    """Where one engine step's time went.

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


# ---- token publishing --------------------------------------------------------------------
# A worker's token streams to the gateways: one TokenBatch per gateway per step, kept for
# a while after it is sent, so that what a gateway missed can be sent again.
#
# Every row carries its place in its request's output (`positions`), so a gateway sees a
# lost batch (a gap) or one it already has (a repeat). When it sees a gap, when its NATS
# connection comes back, or when a stream falls silent, it asks the workers that serve the
# request to send again from the first position it lacks (TokenResend). The worker
# answers from the batches it sent in the last `retention_s` seconds, on the gateway's
# token subject, so the answer stays in order with the batches that follow it. A stream
# whose missing part is older than that is ended with an error: never finished short.

MAX_KEPT_BATCHES = 20_000  # per gateway: a bound on memory whatever the step rate
LOST = "tokens of this stream were lost in transit and are no longer held by the worker"


class TokenPublisher:
    """Collects one step's tokens and sends one TokenBatch per gateway."""

    def __init__(self, nc: NATS, subjects: Subjects, worker_id: str, retention_s: float = 30.0):
        self._nc, self._subjects, self._worker = nc, subjects, worker_id
        self._pending: dict[str, TokenBatch] = {}
        self._kept: dict[str, deque[tuple[float, TokenBatch]]] = {}
        self._retention_s = retention_s
        self.resent_rows = 0
        self.lost_rows = 0
        self._dropped: set[str] = set()  # gateways some of whose kept batches were let go (retention)

    def add(self, gateway_id: str, request_id: str, token_ids: list[int], finish_reason: str | None = None,
            error: str | None = None, logprobs: list[TokenLogprob] | None = None, position: int = 0,
            cached_tokens: int | None = None, prompt_logprobs: PromptLogprobs | None = None) -> None:
        b = self._pending.get(gateway_id)
        if b is None:
            b = self._pending[gateway_id] = TokenBatch([], [], [], worker_id=self._worker)
        elif b.counts is None:  # a whole step went in as it was: copy before appending to it
            b = self._pending[gateway_id] = TokenBatch(list(b.request_ids), list(b.token_ids),
                                                       [1] * len(b.request_ids), list(b.ends), self._worker,
                                                       positions=list(b.positions), handoffs=dict(b.handoffs))
        if (finish_reason is not None or error is not None or logprobs or cached_tokens is not None
                or prompt_logprobs is not None):
            b.ends.append(TokenEnd(len(b.request_ids), finish_reason, error, logprobs, cached_tokens, prompt_logprobs))
        b.request_ids.append(request_id)
        b.token_ids += token_ids
        b.counts.append(len(token_ids))
        b.positions.append(position)

    def hand_off(self, gateway_id: str, request_id: str, worker_id: str) -> None:
        """Tell the gateway that worker_id serves the request from here on (a prefill
        worker handing the KV to another decode worker than the gateway chose). Goes out
        with the next flush, ahead of anything that worker sends."""
        b = self._pending.get(gateway_id)
        if b is None:
            b = self._pending[gateway_id] = TokenBatch([], [], [], worker_id=self._worker)
        b.handoffs[request_id] = worker_id

    def add_step(self, gateway_id: str, out: StepOutputs) -> None:
        """Every row of a step's outputs, for one gateway: the columns go out as they are."""
        ends = {e.row: f for e in out.extras if (f := end_fields(e)) != _NO_END}
        if gateway_id not in self._pending:
            self._pending[gateway_id] = TokenBatch(out.request_ids, out.token_ids, out.counts,
                                                   [TokenEnd(r, *f) for r, f in ends.items()], self._worker,
                                                   positions=out.positions)
            return
        for i, (rid, ids) in enumerate(rows(out)):  # rare: a step plus other updates
            self.add(gateway_id, rid, ids, *ends.get(i, _NO_END), position=out.positions[i])

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        if not pending:
            return
        now = time.time()
        for gw, batch in pending.items():
            batch.sent_at = now
            self._keep(gw, now, batch)
            try:
                await self._nc.publish(self._subjects.gateway_tokens(gw, self._worker), encode(batch))
            except Exception as e:  # NATS down: the gateway asks for the batch again (TokenResend)
                log.warning("token batch for gateway %s not sent: %s", gw, e)

    def _keep(self, gateway_id: str, now: float, batch: TokenBatch) -> None:
        kept = self._kept.get(gateway_id)
        if kept is None:
            kept = self._kept[gateway_id] = deque()
        kept.append((now, batch))
        while kept and (now - kept[0][0] > self._retention_s or len(kept) > MAX_KEPT_BATCHES):
            kept.popleft()
            self._dropped.add(gateway_id)

    def forget(self, gateway_id: str) -> None:
        """The gateway is gone: nobody will ask for its streams again."""
        self._kept.pop(gateway_id, None)
        self._dropped.discard(gateway_id)

    async def resend(self, r: TokenResend) -> None:
        """Send each asked-for request's ids again from its position, with its end if it
        has one; a request whose ids from there are no longer kept gets an error end. A
        request never seen here is left out (another worker serves that part)."""
        for rid, start in self.replay(r):
            self.add(r.gateway_id, rid, *start)
        await self.flush()

    def replay(self, r: TokenResend) -> list[tuple[str, tuple]]:
        """(request id, TokenPublisher.add's arguments after it) per request to send again."""
        want = dict(zip(r.request_ids, r.from_positions))
        found: dict[str, _Gathered] = {}
        for k, (_, b) in enumerate(self._kept.get(r.gateway_id, ())):
            ends = {e.row: e for e in b.ends} if b.ends else None
            i = 0
            for row, rid in enumerate(b.request_ids):
                n = 1 if b.counts is None else b.counts[row]
                if rid in want and b.positions:
                    g = found.get(rid)
                    if g is None:
                        g = found[rid] = _Gathered(want[rid], b.positions[row], k)
                    g.take(b.positions[row], b.token_ids[i : i + n], ends.get(row) if ends else None)
                i += n
        out = []
        dropped = r.gateway_id in self._dropped
        for rid, g in found.items():
            if g.first_pos > want[rid] and (g.first_batch > 0 or not dropped):
                # Its rows here began after the position asked for, and none of its earlier
                # batches were let go: the part before is another worker's (the prefill
                # worker's first token), which that worker sends again. Nothing is lost here;
                # calling it lost failed streams the prefill worker could still complete.
                continue
            if g.furthest > g.next:  # a hole: what it lacks is older than what is kept
                self.lost_rows += 1
                out.append((rid, ([], "error", LOST, None, 0)))
            elif g.ids or g.finish is not None or g.error is not None:
                self.resent_rows += 1
                out.append((rid, (g.ids, g.finish, g.error, g.logprobs or None, want[rid], g.cached, g.prompt)))
        return out


class _Gathered:
    """One request's kept rows from a position on, put back together."""

    __slots__ = ("next", "furthest", "ids", "logprobs", "finish", "error", "cached", "prompt", "first_pos",
                 "first_batch")

    def __init__(self, start: int, first_pos: int, first_batch: int):
        self.next = self.furthest = start
        self.first_pos, self.first_batch = first_pos, first_batch  # its first kept row, and that row's batch
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish = self.error = self.cached = self.prompt = None

    def take(self, pos: int, ids: list[int], end: TokenEnd | None) -> None:
        if ids:
            self.furthest = max(self.furthest, pos + len(ids))
            if pos <= self.next < pos + len(ids):  # goes on from what was gathered
                skip = self.next - pos
                self.ids += ids[skip:]
                if end is not None and end.logprobs:
                    self.logprobs += end.logprobs[skip:]
                if end is not None and end.prompt_logprobs is not None and not skip:  # with the first token
                    self.prompt = end.prompt_logprobs
                self.next = pos + len(ids)
        if end is not None and end.cached_tokens is not None:
            self.cached = end.cached_tokens
        if end is not None and (end.finish_reason is not None or end.error is not None):
            self.finish, self.error = end.finish_reason, end.error


_NO_END = (None, None, None)


def rows(out: StepOutputs):
    """(request id, its new ids) per row of a step's outputs."""
    if out.counts is None:
        yield from ((rid, [t]) for rid, t in zip(out.request_ids, out.token_ids))
        return
    i = 0
    for rid, n in zip(out.request_ids, out.counts):
        yield rid, out.token_ids[i : i + n]
        i += n


def end_fields(e: Finished) -> tuple:
    """(finish reason, error, logprobs) of a row's extras, as TokenEnd takes them."""
    return (e.finish_reason.value if e.finish_reason is not None else None, None, e.logprobs or None)


# ---- tombstones: aborts remembered, each service its own ---------------------------------

class Tombstones:
    """Aborts remembered for a while. An abort can overtake the work it cancels: the
    gateway broadcasts it at once, while the job or the KV hand-off is still on its way. A
    worker that forgot the abort would then run the request for nobody."""

    def __init__(self, ttl_s: float = ABORT_MEMORY_S, max_size: int = MAX_REMEMBERED):
        self._ttl, self._max = ttl_s, max_size
        self._until: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._until.pop(request_id, None)
        self._until[request_id] = now + self._ttl
        self._prune(now)

    def __contains__(self, request_id: str) -> bool:
        until = self._until.get(request_id)
        return until is not None and until > time.monotonic()

    def __len__(self) -> int:
        return len(self._until)

    def _prune(self, now: float) -> None:
        while self._until and (len(self._until) > self._max or next(iter(self._until.values())) <= now):
            self._until.popitem(last=False)
