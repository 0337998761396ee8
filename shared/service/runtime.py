"""What every engine worker (prefill or decode) holds, composed rather than inherited:
a NATS connection, the engine and its loop, the UCX transport with its staging memory,
tracing, metrics, heartbeats, and the per-step token publisher."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from nats.aio.client import Client as NATS

from moemesh.shared.config.common import WorkerConfig
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.engine.mock_model import MockModel
from moemesh.shared.engine.outputs import Finished, StepOutputs
from moemesh.shared.engine.step_account import StepAccount, account
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.protocol.messages import (
    Heartbeat, KVLayout, StatsRequest, TokenBatch, TokenEnd, WorkerLoad, WorkerStats,
)
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.protocol.tokens import TokenLogprob
from moemesh.shared.protocol.wire import encode
from moemesh.shared.service.dep_runtime import DepRuntime
from moemesh.shared.service.engine_loop import EngineLoop, OutputSink
from moemesh.shared.service.heartbeat import Heartbeater
from moemesh.shared.service.kv_sharing import KVSharing
from moemesh.shared.service.metrics_http import MetricsServer
from moemesh.shared.service.nats_io import connect, disconnect, subscribe
from moemesh.shared.telemetry.metrics import Metrics
from moemesh.shared.telemetry.tracing import get_tracer, setup_tracing
from moemesh.shared.telemetry.tracing import shutdown as shutdown_tracing
from moemesh.shared.transport.staging import StagingPool
from moemesh.shared.transport.ucx import UcxTransport

log = logging.getLogger(__name__)
LOAD_REFRESH_S = 0.05


def kv_layout(engine: LLMEngine) -> KVLayout:
    """What a decode worker checks before it takes a prefill worker's KV (KVReady)."""
    cfg = engine.model_config
    dtype = str(engine.kv_dtype).removeprefix("torch.")
    fp = f"{cfg.model_type}:{cfg.hidden_size}x{cfg.num_hidden_layers}:{cfg.vocab_size}"
    if engine.hybrid:
        # A V4 buffer is flat: its length could match between models that file their rows
        # differently (layer types, rates, widths), and the carried window only means
        # something to the model that wrote it. So the whole architecture must match.
        (numel,) = engine.kv_shape(1)
        return KVLayout(cfg.num_cache_layers, engine.cfg.block_size, numel, dtype, f"{fp}:{engine.kv_identity.hex()}")
    layers, _, bs, dim = engine.kv_shape(1)
    return KVLayout(layers, bs, dim, dtype, f"{fp}:{cfg.kv_lora_rank}")


class TokenPublisher:
    """Collects one step's tokens and sends one TokenBatch per gateway."""

    def __init__(self, nc: NATS, subjects: Subjects, worker_id: str):
        self._nc, self._subjects, self._worker = nc, subjects, worker_id
        self._pending: dict[str, TokenBatch] = {}

    def add(self, gateway_id: str, request_id: str, token_ids: list[int], finish_reason: str | None = None,
            error: str | None = None, logprobs: list[TokenLogprob] | None = None) -> None:
        b = self._pending.get(gateway_id)
        if b is None:
            b = self._pending[gateway_id] = TokenBatch([], [], [], worker_id=self._worker)
        elif b.counts is None:  # a whole step went in as it was: copy before appending to it
            b = self._pending[gateway_id] = TokenBatch(list(b.request_ids), list(b.token_ids),
                                                       [1] * len(b.request_ids), list(b.ends), self._worker)
        if finish_reason is not None or error is not None or logprobs:
            b.ends.append(TokenEnd(len(b.request_ids), finish_reason, error, logprobs))
        b.request_ids.append(request_id)
        b.token_ids += token_ids
        b.counts.append(len(token_ids))

    def add_step(self, gateway_id: str, out: StepOutputs) -> None:
        """Every row of a step's outputs, for one gateway: the columns go out as they are."""
        ends = {e.row: f for e in out.extras if (f := end_fields(e)) != _NO_END}
        if gateway_id not in self._pending:
            self._pending[gateway_id] = TokenBatch(out.request_ids, out.token_ids, out.counts,
                                                   [TokenEnd(r, *f) for r, f in ends.items()], self._worker)
            return
        for i, (rid, ids) in enumerate(out.rows()):  # rare: a step plus other updates
            self.add(gateway_id, rid, ids, *ends.get(i, _NO_END))

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        if not pending:
            return
        now = time.time()
        for gw, batch in pending.items():
            batch.sent_at = now
            try:
                await self._nc.publish(self._subjects.gateway_tokens(gw), encode(batch))
            except Exception as e:  # NATS down: the gateway's inactivity timeout covers the request
                log.warning("token batch for gateway %s not sent: %s", gw, e)


_NO_END = (None, None, None)


def end_fields(e: Finished) -> tuple:
    """(finish reason, error, logprobs) of a row's extras, as TokenEnd takes them."""
    return (e.finish_reason.value if e.finish_reason is not None else None, None, e.logprobs or None)


class WorkerRuntime:
    def __init__(self, cfg: WorkerConfig, role: str):
        self.cfg = cfg
        self.role = role
        self.worker_id = cfg.worker_id
        self.subjects = Subjects(cfg.subject_prefix)
        self.nc: NATS | None = None
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.transport: UcxTransport | None = None
        self.staging: StagingPool | None = None
        self.tokens: TokenPublisher | None = None
        self.heartbeat: Heartbeater | None = None
        self.draining = False
        self.metrics = Metrics()
        self.tracer_provider = None
        self.tracer = None
        self._tasks: set[asyncio.Task] = set()  # live ones only: a task per request must not accumulate
        self._subs = []
        self._load = WorkerLoad()
        self._load_at = 0.0
        self._closed = False
        self.dep: DepRuntime | None = None
        self.kv_sharing: KVSharing | None = None
        self._loop_task: asyncio.Task | None = None
        self.metrics_server: MetricsServer | None = None

    async def start(self, on_outputs: OutputSink, engine: LLMEngine | None = None) -> None:
        cfg = self.cfg
        self.tracer_provider = setup_tracing(f"moemesh-{self.role}", cfg.trace_file or None, cfg.otlp_endpoint or None)
        self.tracer = get_tracer(self.tracer_provider, f"moemesh.{self.role}")
        self.dep = DepRuntime(self)
        if engine is not None:
            self.engine = engine
        elif cfg.engine == "mock":
            log.warning("MOCK ENGINE: %s runs no model; tokens are fabricated every %.1f ms. For infrastructure "
                        "benchmarks only.", self.worker_id, cfg.mock_step_ms)
            mock = MockModel(ModelConfig.from_dir(cfg.model), cfg.mock_step_ms / 1e3)
            self.engine = LLMEngine(EngineConfig.for_worker(cfg, self.role), model=mock)
        elif cfg.uses_ep:
            self.engine = await asyncio.to_thread(self.dep.build_engine, self.role)
        else:
            self.engine = await asyncio.to_thread(LLMEngine, EngineConfig.for_worker(cfg, self.role))
        self.layout = kv_layout(self.engine)
        self.transport = UcxTransport(cfg.ucx_net_devices, cfg.ucx_tls)
        await self.transport.start()
        self.staging = StagingPool(cfg.staging_mb << 20, "cpu")
        self.dep.attach(self.engine)
        self.nc = await connect(cfg, f"moemesh-{self.role}-{self.worker_id}")
        self.tokens = TokenPublisher(self.nc, self.subjects, self.worker_id)
        self.loop = EngineLoop(self.engine, on_outputs, lockstep=self.dep.lockstep)
        self.loop.after_ops = self.refresh_load
        self.loop.after_step.append(self._account_step)
        self.h_phase = self.metrics.histogram("step_phase_seconds", "engine step time by phase", ("phase",))
        self.c_steps = self.metrics.counter("steps_total", "engine steps (empty lockstep steps included)")
        self.c_prompt = self.metrics.counter("prompt_tokens_total", "prompt tokens prefilled or reused")
        self.c_cached = self.metrics.counter("prefix_cache_hit_tokens_total",
                                             "prompt tokens whose KV came from the prefix cache")
        self._seen_prompt = self._seen_cached = 0
        self.last_account: StepAccount | None = None
        self.recent_steps: deque[list[float]] = deque(maxlen=4096)
        self.refresh_load()
        self._loop_task = self.spawn(self.loop.run(), "engine-loop")
        await self.sub(self.subjects.stats(self.worker_id), StatsRequest, self._on_stats)
        await self.dep.start()
        self.kv_sharing = KVSharing(self)
        await self.kv_sharing.start()
        if cfg.metrics_port >= 0:
            self.metrics_server = MetricsServer(self.metrics.render, lambda: {"status": "ok", "role": self.role,
                                                                              "draining": self.draining},
                                                cfg.metrics_host, cfg.metrics_port)
            await self.metrics_server.start()
        self.heartbeat = Heartbeater(self.nc, self.subjects, self._beat, cfg.heartbeat_interval_s)
        self.heartbeat.start()

    def spawn(self, coro, name: str) -> asyncio.Task:
        t = asyncio.create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(_log_crash)
        t.add_done_callback(self._tasks.discard)
        return t

    async def sub(self, subject: str, cls, handler, queue: str = "", concurrent: bool = False):
        s = await subscribe(self.nc, subject, cls, handler, queue, concurrent)
        self._subs.append(s)
        return s

    def _account_step(self) -> None:
        dep = self.dep
        comm = dep.ep.take_comm_s() if dep is not None and dep.ep is not None else 0.0
        agree = dep.lockstep.last_agree_s if dep is not None and dep.lockstep is not None else 0.0
        a = self.last_account = account(self.engine.last_stats, comm, agree, self.loop.last_gap_s)
        self.c_steps.inc()
        e = self.engine
        self.c_prompt.inc(e.num_prompt_tokens_total - self._seen_prompt)
        self.c_cached.inc(e.num_cached_tokens_total - self._seen_cached)
        self._seen_prompt, self._seen_cached = e.num_prompt_tokens_total, e.num_cached_tokens_total
        if a.num_seqs:  # empty lockstep steps are waiting, not serving
            self.recent_steps.append([time.time(), a.total_s, a.forward_s, a.host_s, a.rank_wait_s,
                                      self.loop.last_gap_s, a.num_seqs, a.exposed_s])
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
        r, w, free, total, out = self.engine.load()
        self._load = WorkerLoad(r, w, free, total, out, self.engine.pending_prompt_tokens())

    def _beat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id, role=self.role, model=self.cfg.model_name, load=self._load,
            address=self.transport.address, draining=self.draining, instance_id=self.cfg.instance,
            dp_rank=self.cfg.dp_rank, dp_size=self.cfg.dp_size, engine=self.cfg.engine,
            kv_identity=self.engine.kv_identity if self.engine.blocks.enable_caching else b"",
            block_size=self.engine.cfg.block_size,
        )

    def extra_stats(self) -> dict:
        return {}

    async def _on_stats(self, req: StatsRequest, msg, ctx) -> WorkerStats:
        # The snapshot taken after every step and every op: exact when idle, and never
        # stuck behind a long step (a prefill of a long prompt can take seconds).
        load = self._load
        steps = list(self.recent_steps) if req.detail else []
        version = self.dep.agent.version if self.dep is not None and self.dep.agent is not None else 0
        e = self.engine
        counters = {"prompt_tokens": float(e.num_prompt_tokens_total),
                    "prefix_cache_hit_tokens": float(e.num_cached_tokens_total),
                    "kv_pulled_tokens": float(self.kv_sharing.pulled_tokens if self.kv_sharing else 0)}
        return WorkerStats(self.worker_id, self.role, load, staging_bytes_used=self.staging.bytes_used,
                           recent_steps=steps, placement_version=version, counters=counters, **self.extra_stats())

    async def begin_drain(self, job_subs) -> None:
        """Stop taking new work and tell the mesh so, at once."""
        self.draining = True
        for s in job_subs:
            try:
                await s.unsubscribe()
            except Exception:
                pass
        await self.heartbeat.publish_now()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.heartbeat:
            await self.heartbeat.stop()
        if self.metrics_server is not None:
            await self.metrics_server.close()
        if self.loop:
            self.loop.stop()
            if self.loop.lockstep is not None:
                # The ranks stop together (a collective decides); cancelling one would
                # leave the others waiting on it until the group's timeout.
                try:
                    await asyncio.wait_for(asyncio.shield(self._loop_task), self.cfg.dp_timeout_s + 5)
                except (asyncio.TimeoutError, Exception):
                    pass
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.dep is not None:
            self.dep.close()
        if self.nc is not None:
            await disconnect(self.nc)
        if self.transport:
            await self.transport.close()
        if self.tracer_provider is not None:
            shutdown_tracing(self.tracer_provider)


def _log_crash(t: asyncio.Task) -> None:
    if not t.cancelled() and t.exception() is not None:
        log.error("background task %s crashed", t.get_name(), exc_info=t.exception())
