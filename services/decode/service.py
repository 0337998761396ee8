"""The decode worker, with the part only it uses: the receiving of a hand-off's KV into
staging memory (KVReceiver).

Request lifecycle here:
1. announced: KVReady arrives from a prefill worker, with the requests one of its steps
   finished for this worker; each is validated, and the reply names those refused.
2. receiving: staging memory is reserved for all of them and a UCX receive is posted
   before the reply goes; the reply names it, and the prefill worker sends their bytes
   as one message (KVReceiver).
3. importing: each request's bytes are scattered into freshly allocated cache blocks
   (waiting for free blocks if needed); the staging range is freed after the last one.
4. running: continuous batching; new tokens go to the gateway once per step.
5. finished or aborted: blocks freed.
If step 2 fails: "recompute" re-runs the prompt here, "fail" ends the request with an
error; a KVRelease tells the prefill worker to drop its lease either way.

States of a hand-off's receive (TransferState, polled): BOOTSTRAPPING (staging reserved)
-> WAITING_FOR_INPUT (receive posted under a fresh tag; the KVReady reply names it, with
this worker's UCX address and the requests whose bytes it expects, in order) ->
TRANSFERRING -> SUCCESS | FAILED, for the whole message. The receive is posted before
the reply goes, so the sender never waits for the receiver. A sender that cannot send
says so (KVSendFailed, by tag) and the receive fails at once; a sender that says nothing
leaves it to the transfer timeout. Clean-up on failure is the staged receive's
(StagedReceive, shared/transport/staging.py). The staging range is shared by the
requests' imports, which happen one by one as cache blocks free up: it is freed when the
last of them is done (imported, failed or aborted).

Parallel sampling: children of one prompt may come as one item (KVReadyItem.forks), their
prompt's KV once in its bytes; each is a request of its own here (refused, aborted,
decoded and ended alone), and they are imported together (engine/fork_io.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from opentelemetry import trace

from moemesh.services.decode.config import DecodeConfig
from moemesh.shared.engine import fork_io
from moemesh.shared.engine.engine import RequestError
from moemesh.shared.engine.outputs import StepOutputs, StepStats
from moemesh.shared.kv.spec import compatible
from moemesh.shared.protocol.messages import (
    ALREADY_SERVED, Abort, Ack, ErrorReply, KVReady, KVReadyItem, KVReadyReply, KVRelease, KVSendFailed, PrefillJob,
    SamplingParamError,
)
from moemesh.shared.service.lifecycle import AsyncService
from moemesh.shared.service.nats_io import publish
from moemesh.shared.service.gateway_watch import GatewayWatch
from moemesh.shared.service.runtime import PhaseLog, Tombstones, TransportFactory, WorkerRuntime, end_fields, rows
from moemesh.shared.telemetry.tracing import exports_spans, extract_context, traceparent_of
from moemesh.shared.transport.base import KVTransport, TransferError, TransferState
from moemesh.shared.transport.staging import StagedReceive, StagingPool, StagingSlot

log = logging.getLogger(__name__)
# Step events per request span: each step is told once, on the span of one request it ran
# (the first of its rows whose span has room), which is all `moemesh profile` needs; a span
# a token would cost every request of a batch several microseconds a step.
MAX_STEP_EVENTS = 32
DRAIN_HANDOFF_GRACE_S = 0.5
# For this long after a hand-off, more are expected: steps are planned late for them to join.
ARRIVING_S = 0.25


@dataclass
class Active:
    gateway_id: str
    span: trace.Span
    t0: float
    steps: int = 0
    step_events: int = 0
    # The hand-off's phases (PhaseLog): dispatch and transfer once the bytes are in, and
    # when they were (perf_counter), until the first step it runs in has landed.
    dispatch_s: float = 0.0
    transfer_s: float = 0.0
    landed_at: float = 0.0


# ---- receiving the KV of one hand-off: the second leg, after the KVReady reply ----------
@dataclass
class Pull:
    """One request of a hand-off, with the children of its prompt whose KV moves with it
    (KVReadyItem.forks): one range of bytes, one lease."""
    item: KVReadyItem
    batch: "PullBatch"
    offset: int  # of its bytes in the batch's staging range
    skip: set[str] = field(default_factory=set)  # requests in it refused or aborted: not to run
    done: bool = False  # imported, failed or dropped: it no longer needs the staging range

    @property
    def request_id(self) -> str:
        """The request that names its lease."""
        return self.item.request_id

    @property
    def request_ids(self) -> list[str]:
        return [self.item.request_id, *(f.request_id for f in self.item.forks)]

    @property
    def aborted(self) -> bool:
        return all(r in self.skip for r in self.request_ids)

    def abort(self, request_id: str) -> None:
        self.skip.add(request_id)

    @property
    def state(self) -> TransferState:
        return self.batch.state

    @property
    def error(self) -> str:
        return self.batch.error

    def staging(self) -> StagingSlot:
        return self.batch.rx.slot.part(self.offset, self.item.nbytes)


@dataclass
class PullBatch:
    ready: KVReady
    pulls: list[Pull] = field(default_factory=list)
    rx: StagedReceive | None = None
    sender_failed: asyncio.Future | None = None  # the sender's reason, if it says it cannot send

    @property
    def nbytes(self) -> int:
        return sum(p.item.nbytes for p in self.pulls)

    @property
    def state(self) -> TransferState:
        return TransferState.BOOTSTRAPPING if self.rx is None else self.rx.state

    @property
    def error(self) -> str:
        return self.rx.error if self.rx is not None else ""


class KVReceiver:
    """The decode side of hand-offs: posts a batch's receive, waits for its bytes (or the
    sender's word that they will not come), and frees staging after the last import."""

    def __init__(self, transport: KVTransport, staging: StagingPool, timeout_s: float):
        self._transport, self._staging, self._timeout_s = transport, staging, timeout_s
        self._waiting: dict[int, PullBatch] = {}  # tag -> a batch whose bytes are on their way

    @property
    def address(self) -> bytes:
        return self._transport.address

    @property
    def in_flight(self) -> int:
        """Hand-offs whose bytes are on their way."""
        return len(self._waiting)

    def post(self, batch: PullBatch) -> int:
        """Reserve the batch's staging and post its receive. Returns its tag, or 0 when
        it cannot be received (staging full: the batch is FAILED, and nothing is to be sent)."""
        rx = batch.rx = StagedReceive(self._transport, self._staging, batch.nbytes, "decode")
        if rx.state is TransferState.FAILED:
            return 0
        rx.post()
        batch.sender_failed = asyncio.get_running_loop().create_future()
        self._waiting[rx.tag] = batch
        return rx.tag

    def sender_failed(self, tag: int, error: str) -> None:
        """The sender of `tag` will not send (an unknown tag is ignored: already over)."""
        b = self._waiting.get(tag)
        if b is not None and not b.sender_failed.done():
            b.sender_failed.set_result(error)

    async def wait(self, batch: PullBatch) -> None:
        """Until the batch's bytes are in staging, or it is FAILED (rx.error says why)."""
        rx = batch.rx
        if rx is None or rx.state is TransferState.FAILED:
            return
        landed = asyncio.ensure_future(rx.wait(self._timeout_s))
        try:
            await asyncio.wait({landed, batch.sender_failed}, return_when=asyncio.FIRST_COMPLETED)
            if not landed.done():
                rx.fail(f"the prefill worker did not send: {batch.sender_failed.result()}")
                landed.cancel()
            with contextlib.suppress(TransferError, asyncio.CancelledError):
                await landed
        finally:
            self._waiting.pop(rx.tag, None)
            if not landed.done():
                landed.cancel()

    @staticmethod
    def finish(pull: Pull) -> None:
        """This request no longer needs its bytes; the last one out frees the staging range."""
        pull.done = True
        b = pull.batch
        if b.rx is not None and all(p.done for p in b.pulls):
            b.rx.release()


class DecodeService(AsyncService):
    def __init__(self, cfg: DecodeConfig, engine=None, transport: TransportFactory | None = None):
        """engine: one built already (tests), else made from cfg. transport: makes the KV
        transport (default UCX; tests give the loopback double)."""
        self.cfg = cfg
        self.rt = WorkerRuntime(cfg, "decode", self._on_outputs, engine, transport,
                                lambda detail: {"num_transfers": len(self.pulls),
                                                "requests_by_gateway": dict(self._gateways),
                                                **self.phases.stats_fields(detail)})
        self.pulls: dict[str, Pull] = {}
        self.receiver: KVReceiver | None = None  # once the transport is up (start)
        self.aborted = Tombstones()
        self.gateways = GatewayWatch(self._gateway_gone)
        self.active: dict[str, Active] = {}
        self._gateways: Counter[str] = Counter()  # gateways of the active requests
        self._step_events = False
        self._dummy: dict[tuple[int, ...], torch.Tensor] = {}  # bench_dummy_kv
        self._job_subs = []
        # dispatch: the prefill worker's first token -> its KVReady here; transfer: -> the
        # bytes in staging; import: -> into the cache and a step that ran; first_step: that
        # step. Together, what the hand-off adds before the second token.
        self.phases = PhaseLog(self.rt.metrics, "handoff_phase_seconds",
                               "a request's hand-off from prefill to its first decode step, by phase",
                               ("dispatch", "transfer", "import", "first_step"))
        self._joining: dict[str, Active] = {}  # imported, its first step not landed yet
        self._last_ready = -ARRIVING_S  # monotonic time of the last KVReady

    async def start(self) -> None:
        rt = self.rt
        await rt.start()
        # A gateway is not silent because our own link to NATS is down.
        rt.bus.link.down.append(self.gateways.registry.hold)
        rt.bus.link.up.append(self.gateways.registry.resume)
        s = rt.subjects
        # Not a job subscription: a draining worker still takes the hand-off of a request that
        # was routed to it before it announced the drain (its prompt is already computed).
        self.receiver = KVReceiver(rt.transport, rt.staging, self.cfg.transfer_timeout_s)
        # While hand-offs come in, the next step is planned late enough for them to join it.
        rt.loop.arriving = self._arriving
        await rt.sub(s.decode_kv_ready(rt.worker_id), KVReady, self._on_ready)
        await rt.sub(s.decode_kv_failed(rt.worker_id), KVSendFailed, self._on_send_failed)
        if self.cfg.bench_dummy_kv:
            log.warning("BENCH MODE: requests to %s get a dummy KV cache instead of a prefill; outputs are "
                        "meaningless. Never use this for serving.", s.decode_bench_job(rt.worker_id))
            self._job_subs.append(await rt.sub(s.decode_bench_job(rt.worker_id), PrefillJob, self._on_bench_job))
        await rt.sub(s.abort, Abort, self._on_abort)
        await rt.bus.on_heartbeat(self.gateways.observe)
        rt.spawn(self.gateways.run(), "gateway-watch")
        m = rt.metrics
        self.m_pull = m.histogram("kv_pull_seconds", "time to pull one request's KV")
        self.m_pull_bytes = m.counter("kv_bytes_received_total", "KV bytes received")
        self.m_pull_fail = m.counter("kv_pull_failures_total", "KV pulls that failed", ("action",))
        self.m_step = m.histogram("decode_step_seconds", "decode engine step time")
        # Per-request step events cost a few microseconds per token: only when spans leave the process.
        self._step_events = exports_spans(rt.tracer_provider)
        log.info("decode worker %s ready (model %s)", rt.worker_id, self.cfg.model_name)

    async def drain(self) -> None:
        await self.rt.begin_drain(self._job_subs)
        # A request the gateway routed here just before it heard of the drain may still be
        # in its prefill: its hand-off is taken for a short while (prefill workers send it
        # elsewhere after that).
        grace = time.monotonic() + min(DRAIN_HANDOFF_GRACE_S, self.cfg.heartbeat_interval_s)
        while self.pulls or self.active or time.monotonic() < grace:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self.rt.close()

    async def failed(self) -> str:
        return await self.rt.failed()

    # ---- hand-off from prefill --------------------------------------------------------
    async def _on_ready(self, r: KVReady, msg, ctx):
        rt = self.rt
        dispatch_s = max(0.0, time.time() - r.first_token_at) if r.first_token_at else 0.0
        self._last_ready = time.monotonic()
        if not (c := compatible(rt.kv_spec, r.layout)):
            return ErrorReply(f"incompatible KV layout: {c.reason}", "bad_request")
        batch, refused, off = PullBatch(r), {}, 0
        for item in r.items:
            members = [(item.request_id, item.sampling, item.output_ids, item.traceparent),
                       *((f.request_id, f.sampling, f.output_ids, f.traceparent) for f in item.forks)]
            skip = set()
            for rid, sampling, output_ids, _ in members:
                why = self._refusal(rid, sampling, output_ids)
                if why:
                    refused[rid] = why
                    skip.add(rid)
            if len(skip) == len(members):
                continue
            pull = Pull(item, batch, off, skip=skip)
            for rid, _, _, traceparent in members:
                if rid in skip:
                    continue
                span = rt.tracer.start_span("decode", context=extract_context({"traceparent": traceparent}),
                                            attributes={"request.id": rid, "worker.id": rt.worker_id,
                                                        "prompt.tokens": len(item.prompt_ids)})
                self._activate(rid, Active(item.gateway_id, span, time.monotonic(), dispatch_s=dispatch_s))
                self.pulls[rid] = pull
            batch.pulls.append(pull)
            off += item.nbytes
        if not batch.pulls:
            return KVReadyReply(refused)
        spans = self._transfer_spans(batch)
        tag = self.receiver.post(batch)
        rt.spawn(self._receive_and_import(batch, spans), f"receive-{r.prefill_id}")
        if not tag:  # staging is full: nothing is to be sent, and the requests go the failure's way
            return KVReadyReply(refused)
        return KVReadyReply(refused, self.receiver.address, tag, [p.request_id for p in batch.pulls],
                            [traceparent_of(sp) for sp in spans])

    def _arriving(self) -> bool:
        return bool(self.receiver.in_flight) or time.monotonic() - self._last_ready < ARRIVING_S

    async def _on_send_failed(self, m: KVSendFailed, msg, ctx) -> None:
        self.receiver.sender_failed(m.tag, f"{m.prefill_id}: {m.error}")

    def _refusal(self, request_id: str, sampling, output_ids: list[int]) -> str:
        try:
            sampling.to_params()
        except SamplingParamError as e:
            return str(e)
        if not output_ids:
            return "KVReady must carry the first sampled token"
        if request_id in self.pulls or request_id in self.active:
            return ALREADY_SERVED
        if request_id in self.aborted:
            return "aborted"
        return ""

    def _transfer_spans(self, batch: PullBatch) -> list[trace.Span]:
        """A `kv.transfer` span per request, begun as the receive is posted: the prefill
        worker's `kv.send` spans are their children (KVReadyReply.traceparents)."""
        out = []
        for p in batch.pulls:
            act = self.active.get(p.request_id)
            out.append(self.rt.tracer.start_span(
                "kv.transfer", context=trace.set_span_in_context(act.span) if act else None,
                attributes={"kv.bytes": p.item.nbytes, "kv.blocks": p.item.num_blocks,
                            "prefill.id": batch.ready.prefill_id, "kv.batch_requests": len(batch.pulls)}))
        return out

    async def _receive_and_import(self, batch: PullBatch, spans: list[trace.Span]) -> None:
        t0 = time.perf_counter()
        await self.receiver.wait(batch)
        t1 = time.perf_counter()
        dt = t1 - t0
        for span, p in zip(spans, batch.pulls):
            span.set_attribute("kv.seconds", dt)
            if p.state == TransferState.FAILED:
                span.set_status(trace.StatusCode.ERROR, p.error)
            span.end()
        if batch.state == TransferState.SUCCESS:
            self.m_pull.observe(dt)
            self.m_pull_bytes.inc(batch.nbytes)
        for p in batch.pulls:
            if p.state == TransferState.SUCCESS:
                for rid in p.request_ids:
                    if (act := self.active.get(rid)) is not None:
                        act.transfer_s, act.landed_at = dt, t1
                self._import(p)
            else:
                await self._pull_failed(p)

    async def _pull_failed(self, pull: Pull) -> None:
        rt, item = self.rt, pull.item
        await self._release_remote(pull, ok=False)
        self._drop_pull(pull)
        if pull.aborted:
            return
        action = self.cfg.on_transfer_failure
        self.m_pull_fail.labels(action).inc()
        rt.handoff_failed()
        log.warning("KV pull for %s failed (%s); %s", item.request_id, pull.error, action)
        for rid, output_ids, sampling in [(item.request_id, item.output_ids, item.sampling),
                                          *((f.request_id, f.output_ids, f.sampling) for f in item.forks)]:
            if rid in pull.skip:
                continue
            act = self.active.get(rid)
            if act is not None:
                act.span.add_event("kv_pull_failed", {"error": pull.error, "action": action})
            if action == "recompute":  # each child on its own
                params = sampling.to_params()
                try:
                    await rt.loop.call(lambda e: e.add_request(rid, item.prompt_ids, params, output_ids))
                except RequestError as e:
                    await self._fail(rid, f"recompute refused: {e}")
            else:
                await self._fail(rid, f"KV transfer failed: {pull.error}")

    def _import(self, pull: Pull) -> None:
        """Between steps, once blocks are free: scatter the request's bytes into the cache."""
        rt, item = self.rt, pull.item
        if item.forks:
            return self._import_forks(pull)
        params = item.sampling.to_params()
        dtype, shape = rt.kv_spec.dtype, rt.kv_spec.shape(item.num_blocks)

        def attempt(engine) -> bool:
            if pull.aborted:
                self._drop_pull(pull)
                return True
            if not engine.can_import(len(item.prompt_ids)):
                return False  # wait for blocks to free up
            try:
                engine.add_prefilled(item.request_id, item.prompt_ids + item.output_ids, len(item.prompt_ids),
                                     params, pull.staging().typed(dtype, shape), item.draft_ids)
                self._joined([item.request_id])
            except RequestError as e:
                rt.spawn(self._fail(item.request_id, f"import refused: {e}"), "fail")
            finally:
                self._drop_pull(pull)
            return True

        rt.loop.retry_each_step(attempt, params.priority)  # blocks that free up go to the best class first

    def _import_forks(self, pull: Pull) -> None:
        """The children of one prompt, their bytes as one buffer: imported together."""
        rt, item = self.rt, pull.item
        members = [(item.request_id, item.prompt_ids + item.output_ids, item.sampling.to_params(), item.draft_ids),
                   *((f.request_id, item.prompt_ids + f.output_ids, f.sampling.to_params(), f.draft_ids)
                     for f in item.forks)]
        n_prompt, dtype = len(item.prompt_ids), rt.kv_spec.dtype
        shape = rt.kv_spec.shape(item.num_blocks, len(members))

        def attempt(engine) -> bool:
            skip = pull.skip | {m[0] for m in members if m[0] not in self.active}  # aborted meanwhile
            if len(skip) == len(members):
                self._drop_pull(pull)
                return True
            if not fork_io.can_import(engine, n_prompt, len(members) - len(skip)):
                return False  # wait for blocks to free up
            try:
                fork_io.add(engine, members, n_prompt, pull.staging().typed(dtype, shape), skip)
                self._joined([m[0] for m in members if m[0] not in skip])
            except RequestError as e:
                for rid, *_ in members:
                    if rid not in skip:
                        rt.spawn(self._fail(rid, f"import refused: {e}"), "fail")
            finally:
                self._drop_pull(pull)
            return True

        rt.loop.retry_each_step(attempt, members[0][2].priority)

    def _joined(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if (act := self.active.get(rid)) is not None and act.landed_at:
                self._joining[rid] = act

    def _landed_first_steps(self, out: StepOutputs) -> None:
        """Record the hand-off of each request this step was the first to run."""
        a, now = self.rt.last_account, time.perf_counter()
        step_s = a.total_s if a is not None else 0.0
        ran = set(out.request_ids)
        for rid in [r for r in self._joining if r in ran]:
            act = self._joining.pop(rid)
            self.phases.record(act.dispatch_s, act.transfer_s, max(0.0, now - act.landed_at - step_s), step_s)

    def _drop_pull(self, pull: Pull) -> None:
        KVReceiver.finish(pull)
        for rid in pull.request_ids:
            if self.pulls.get(rid) is pull:
                del self.pulls[rid]

    async def _release_remote(self, pull: Pull, ok: bool) -> None:
        try:
            await publish(self.rt.nc, self.rt.subjects.kv_release(pull.batch.ready.prefill_id),
                          KVRelease(pull.request_id, pull.item.lease_id, ok))
        except Exception as e:  # the prefill lease expires on its own
            log.debug("release not sent: %s", e)

    def _activate(self, request_id: str, act: Active) -> None:
        self.active[request_id] = act
        self._gateways[act.gateway_id] += 1

    def _deactivate(self, request_id: str) -> Active | None:
        self._joining.pop(request_id, None)
        act = self.active.pop(request_id, None)
        if act is not None:
            self._gateways[act.gateway_id] -= 1
            if not self._gateways[act.gateway_id]:
                del self._gateways[act.gateway_id]
        return act

    async def _fail(self, request_id: str, error: str) -> None:
        act = self._deactivate(request_id)
        if act is None:
            return
        act.span.set_status(trace.StatusCode.ERROR, error)
        act.span.end()
        self.rt.tokens.add(act.gateway_id, request_id, [], "error", error)
        await self.rt.tokens.flush()

    def _dummy_kv(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Random KV of a shape, made once: drawing it per request cost the event loop more
        than importing it, which a benchmark of the serving path must not measure."""
        t = self._dummy.get(shape)
        if t is None:
            e = self.rt.engine
            t = self._dummy[shape] = torch.randn(shape, dtype=e.kv_dtype, device=e.device)
        return t

    async def _on_bench_job(self, job: PrefillJob, msg, ctx):
        """Decode-only benchmarking: fabricate the prompt's KV (random values) and decode."""
        rt = self.rt
        try:
            params = job.sampling.to_params()
        except SamplingParamError as e:
            return ErrorReply(str(e), "bad_request")
        if job.request_id in self.active:
            return ErrorReply(f"duplicate request {job.request_id}", "bad_request")
        n = len(job.prompt_ids)
        shape = rt.engine.kv_shape(rt.engine.blocks_for(n))
        first = job.prompt_ids[-1]
        span = rt.tracer.start_span("decode", context=ctx, attributes={
            "request.id": job.request_id, "worker.id": rt.worker_id, "prompt.tokens": n, "bench.dummy_kv": True})
        self._activate(job.request_id, Active(job.gateway_id, span, time.monotonic()))

        def attempt(engine) -> bool:
            if job.request_id not in self.active:
                return True
            if not engine.can_import(n):
                return False
            try:
                engine.add_prefilled(job.request_id, job.prompt_ids + [first], n, params, self._dummy_kv(shape))
            except RequestError as e:
                rt.spawn(self._fail(job.request_id, f"bench request refused: {e}"), "fail")
            return True

        rt.loop.retry_each_step(attempt, params.priority)
        return Ack()

    # ---- steps ------------------------------------------------------------------------------
    async def _on_outputs(self, out: StepOutputs, stats: StepStats) -> None:
        rt = self.rt
        if stats.num_seqs and rt.last_account is not None:
            self.m_step.observe(rt.last_account.total_s)
        if len(self._gateways) == 1:  # the common case: the step's columns go out as they are
            rt.tokens.add_step(next(iter(self._gateways)), out)
        else:
            ends = {e.row: e for e in out.extras}
            for i, (rid, ids) in enumerate(rows(out)):
                act = self.active.get(rid)
                if act is not None:
                    e = ends.get(i)
                    rt.tokens.add(act.gateway_id, rid, ids, *(end_fields(e) if e is not None else (None,) * 3),
                                  position=out.positions[i])
        if self._joining:
            self._landed_first_steps(out)
        if self._step_events:
            self._add_step_events(out, stats)
        for e in out.extras:
            if e.finish_reason is None:
                continue
            rid = out.request_ids[e.row]
            act = self._deactivate(rid)
            if act is None:
                continue
            if e.block_hashes and rt.kv_sharing.peers.live("kv_store"):  # the next turn's prefix, for the store
                rt.kv_sharing.push_soon(e.block_hashes)
            act.span.set_attribute("finish.reason", e.finish_reason.value)
            if self._step_events:
                act.span.set_attribute("decode.steps", act.steps)
            act.span.end()
        await rt.tokens.flush()

    def _add_step_events(self, out: StepOutputs, stats: StepStats) -> None:
        told = False
        for rid, ids in rows(out):
            act = self.active.get(rid)
            if act is None:
                continue
            act.steps += 1
            if not told and act.step_events < MAX_STEP_EVENTS:
                told = True
                act.step_events += 1
                a = self.rt.last_account
                act.span.add_event("step", {"tokens": len(ids), "batch.num_seqs": stats.num_seqs,
                                            "forward_ms": a.forward_s * 1e3, "host_ms": a.host_s * 1e3,
                                            "host_exposed_ms": a.exposed_s * 1e3, "rank_wait_ms": a.rank_wait_s * 1e3})

    async def _gateway_gone(self, gateway_id: str) -> None:
        self.rt.tokens.forget(gateway_id)
        mine = [rid for rid, act in self.active.items() if act.gateway_id == gateway_id]
        if mine:
            await self._on_abort(Abort(mine, "gateway gone"), None, None)

    async def _on_abort(self, a: Abort, msg, ctx) -> None:
        for rid in a.request_ids:
            self.aborted.add(rid)  # its hand-off may still be on the way
            pull = self.pulls.get(rid)
            if pull is not None:
                pull.abort(rid)
            act = self._deactivate(rid)
            if act is not None:
                act.span.add_event("aborted", {"reason": a.reason})
                act.span.end()
                await self.rt.loop.call(lambda e, r=rid: e.abort(r))
