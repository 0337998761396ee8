"""The prefill worker, with the parts only it uses: the leases on the KV it holds for
decode workers (LeaseTable), and the sending of that KV once one has posted its receive
(KVSender).

Request lifecycle here:
1. queued: a PrefillJob arrives through the `prefill` queue group, is validated and
   acknowledged, and enters the engine.
2. prefilling: the prompt is computed, in chunks, batched with other prompts.
3. held: the first token is sampled. It goes straight to the gateway; the KV blocks
   stay allocated under a lease, and KVReady goes to the decode worker the gateway chose,
   one message for all the requests of a step that go there.
4. sent: the decode worker's reply has posted a receive for them; their blocks are
   gathered end to end into staging memory, sent over UCX as one message (KVSender),
   and freed. Or refused, or no decode worker took them: the blocks are freed.

States of a send: BOOTSTRAPPING (KVReady out; the leases are held for it and no abort
frees them) -> TRANSFERRING (their blocks gathered end to end into staging memory, then
one UCX send to the reply's address and tag) -> SUCCESS | FAILED. A send that fails, or
never starts (staging full, an address no live decode worker has), is told to the
receiver by tag (KVSendFailed), so it fails at once rather than at its timeout.

A job of n > 1 (parallel sampling) is n requests here from the start, named and seeded
by protocol/forks.py: each has its own state, span, first token, lease and hand-off, and
is aborted on its own. Only the engine sees them as one prompt (engine/fork.py), which it
computes once. The children held in one step move as one KVReadyItem under one lease
(the first child's, the others its `forks`): the prompt's KV once, then the block each
owns (engine/fork_io.py). The lease goes when it is sent, or expires, or when every
child in it is aborted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from opentelemetry import trace

from moemesh.services.prefill.config import PrefillConfig
from moemesh.shared.engine import block_io, fork_io
from moemesh.shared.engine.engine import RequestError
from moemesh.shared.engine.outputs import StepOutputs, StepStats
from moemesh.shared.protocol.forks import MAX_N, fork_ids, fork_params
from moemesh.shared.protocol.prefix_hash import chain
from moemesh.shared.protocol.registry import KVPeers, first_beat_wait_s
from moemesh.shared.protocol.messages import (
    ALREADY_SERVED,
    Abort,
    Ack,
    ErrorReply,
    KVFork,
    KVReady,
    KVReadyItem,
    KVReadyReply,
    KVRelease,
    KVSendFailed,
    PrefillJob,
    SamplingParamError,
    WireSampling,
)
from moemesh.shared.kv.spec import KVSpec
from moemesh.shared.service.lifecycle import AsyncService
from moemesh.shared.service.nats_io import RemoteError, Unreachable, publish, request
from moemesh.shared.service.gateway_watch import GatewayWatch
from moemesh.shared.service.runtime import PhaseLog, Tombstones, TransportFactory, WorkerRuntime
from moemesh.shared.telemetry.tracing import extract_context, traceparent_of
from moemesh.shared.transport.base import KVTransport, TransferError
from moemesh.shared.transport.staging import StagingPool

log = logging.getLogger(__name__)


def start_time_ns(stats: StepStats) -> int:
    """Wall-clock start of the step these stats describe."""
    return time.time_ns() - int(stats.total_s * 1e9)


@dataclass
class Handoff:
    job: PrefillJob
    span: trace.Span
    lease: object
    output_ids: list[int]
    draft_ids: list[int]  # MTP drafts for the decode worker's first step
    forks: list["Handoff"] = field(default_factory=list)  # children whose KV moves with this one's


@dataclass
class JobState:
    job: PrefillJob
    span: trace.Span  # the request's span on this worker
    t0: float
    phase: trace.Span  # "queue.wait" until first scheduled, then "prefill.batch"
    scheduled: bool = False
    queued_ns: int = 0
    scheduled_ns: int = 0  # wall clock: when a step first computed it
    parent: str = ""  # a child's: the job it was forked from (its prompt's KV may move with its siblings')


# ---- leases: KV held for a decode worker, one lease per request, with an expiry ----------
_lease_ids = itertools.count(1)


@dataclass
class Lease:
    job: PrefillJob
    num_blocks: int
    nbytes: int
    expires_at: float
    lease_id: int = field(default_factory=lambda: next(_lease_ids))
    pulling: bool = False
    # Parallel sampling: children of the job's prompt whose KV moves with it (one buffer),
    # and those of all of them not aborted yet; the lease goes when none is left.
    forks: list[str] = field(default_factory=list)
    live: set[str] = field(default_factory=set)

    @property
    def request_ids(self) -> list[str]:
        return [self.job.request_id, *self.forks]


class LeaseTable:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.by_request: dict[str, Lease] = {}  # by the request that names it
        self._fork_of: dict[str, str] = {}  # a fork's request id -> the one naming its lease

    def grant(self, job: PrefillJob, num_blocks: int, nbytes: int, now: float | None = None,
              forks: list[str] = ()) -> Lease:
        now = time.monotonic() if now is None else now
        lease = Lease(job, num_blocks, nbytes, now + self.timeout_s, forks=list(forks))
        lease.live = set(lease.request_ids)
        self.by_request[job.request_id] = lease
        for rid in forks:
            self._fork_of[rid] = job.request_id
        return lease

    def of(self, request_id: str) -> Lease | None:
        """The lease that holds a request's KV, whether it names it or is a fork in it."""
        return self.by_request.get(self._fork_of.get(request_id, request_id))

    def get(self, request_id: str, lease_id: int) -> Lease | None:
        lease = self.by_request.get(request_id)
        return lease if lease is not None and lease.lease_id == lease_id else None

    def pop(self, request_id: str) -> Lease | None:
        lease = self.by_request.pop(request_id, None)
        if lease is not None:
            for rid in lease.forks:
                self._fork_of.pop(rid, None)
        return lease

    def expired(self, now: float | None = None) -> list[Lease]:
        now = time.monotonic() if now is None else now
        return [l for l in self.by_request.values() if l.expires_at <= now and not l.pulling]

    def __len__(self) -> int:
        return len(self.by_request)


# ---- sending the KV of one hand-off: the second leg, after the KVReady reply ----------
INLINE_EXPORT_BYTES = 1 << 20  # larger exports are copied on a thread, off the event loop


class KVSender:
    def __init__(self, engine, spec: KVSpec, staging: StagingPool, transport: KVTransport, peers: KVPeers,
                 timeout_s: float, heartbeat_interval_s: float, fault: str = ""):
        """peers: the live decode workers, whose addresses alone get bytes. fault: the
        prefill config's debug_kv_fault ("drop": send nothing, say nothing; "error": fail)."""
        self._engine, self._spec, self._staging, self._transport = engine, spec, staging, transport
        self._peers, self._timeout_s, self._fault = peers, timeout_s, fault
        self._known_wait_s = first_beat_wait_s(heartbeat_interval_s)

    async def send(self, address: bytes, tag: int, leases: list[Lease]) -> int:
        """Gather the leases' blocks end to end, in order, and send them as one message.
        Returns the bytes sent. Raises TransferError (the message says why) when it
        cannot."""
        if not await self._peers.known_within(address, self._known_wait_s):
            raise TransferError("the receiving address belongs to no live decode worker")
        if self._fault == "error":
            raise TransferError("injected fault")
        total = sum(lease.nbytes for lease in leases)
        slot = self._staging.alloc(total)
        if slot is None:
            raise TransferError(f"prefill staging memory is full ({total} bytes needed)")
        try:
            off = 0
            for lease in leases:
                shape = self._spec.shape(lease.num_blocks, 1 + len(lease.forks))  # V4: a ring window per child
                dst = slot.part(off, lease.nbytes).typed(self._spec.dtype, shape)
                # A held request's blocks are never written by a step, so the copy runs beside
                # the engine, not between its steps: a send never waits behind a long prefill.
                # A small one is cheaper here than a thread's round trip.
                if lease.nbytes <= INLINE_EXPORT_BYTES:
                    _export(self._engine, lease, dst)
                else:
                    await asyncio.to_thread(_export, self._engine, lease, dst)
                off += lease.nbytes
            if self._fault != "drop":
                await self._transport.send(address, slot.buffer(), tag, self._timeout_s)
            return total
        except KeyError as e:  # a lease's blocks are gone: a bug, reported as a failed send
            raise TransferError(f"KV export failed: {e}") from None
        finally:
            self._staging.free(slot)


def _export(engine, lease: Lease, dst) -> None:
    if lease.forks:
        fork_io.export(engine, lease.request_ids, dst)
    else:
        engine.export_kv(lease.job.request_id, dst)


class PrefillService(AsyncService):
    def __init__(self, cfg: PrefillConfig, engine=None, transport: TransportFactory | None = None):
        """engine: one built already (tests), else made from cfg. transport: makes the KV
        transport (default UCX; tests give the loopback double)."""
        self.cfg = cfg
        self.rt = WorkerRuntime(cfg, "prefill", self._on_outputs, engine, transport,
                                lambda detail: {"num_held": len(self.leases), "requests_by_gateway": self._by_gateway(),
                                                **self.phases.stats_fields(detail)})
        self.jobs: dict[str, JobState] = {}
        self.aborted = Tombstones()
        self.gateways = GatewayWatch(self._gateway_gone)
        self.leases = LeaseTable(cfg.lease_timeout_s)
        self.peers = KVPeers("decode")  # decode workers, to vet the UCX addresses we send to
        self.sender: KVSender | None = None  # once the transport is up (start)
        self._job_subs = []
        # queue: the job's arrival -> a step first computes it; prefill: -> its first token
        self.phases = PhaseLog(self.rt.metrics, "prefill_phase_seconds",
                               "a prompt's time on the prefill worker, by phase", ("queue", "prefill"))

    async def start(self) -> None:
        rt = self.rt
        await rt.start()
        self.sender = KVSender(rt.engine, rt.kv_spec, rt.staging, rt.transport, self.peers,
                               self.cfg.transfer_timeout_s, self.cfg.heartbeat_interval_s, self.cfg.debug_kv_fault)
        # A gateway is not silent because our own link to NATS is down.
        rt.bus.link.down.append(self.gateways.registry.hold)
        rt.bus.link.up.append(self.gateways.registry.resume)
        s = rt.subjects
        self._job_subs.append(await rt.sub(s.prefill_jobs, PrefillJob, self._on_job, queue=s.prefill_queue_group))
        self._job_subs.append(await rt.sub(s.prefill_direct(rt.worker_id), PrefillJob, self._on_job))
        await rt.sub(s.kv_release(rt.worker_id), KVRelease, self._on_release)
        await rt.sub(s.abort, Abort, self._on_abort)
        await rt.bus.on_heartbeat(self.gateways.observe)
        await rt.bus.on_heartbeat(self.peers.observe)
        rt.spawn(self._reap_leases(), "lease-reaper")
        rt.spawn(self.gateways.run(), "gateway-watch")
        m = rt.metrics
        self.m_prefill = m.histogram("prefill_seconds", "queue + compute time per prompt")
        self.m_sent = m.counter("kv_bytes_sent_total", "KV bytes sent to decode workers")
        self.m_expired = m.counter("kv_leases_expired_total", "held KV freed because nobody pulled it")
        log.info("prefill worker %s ready (model %s)", rt.worker_id, self.cfg.model_name)

    async def drain(self) -> None:
        await self.rt.begin_drain(self._job_subs)
        while self.jobs or len(self.leases):
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self.rt.close()

    async def failed(self) -> str:
        return await self.rt.failed()

    def _by_gateway(self) -> dict[str, int]:
        """Gateway -> requests held for it, queued or computed and waiting for their pull."""
        held = Counter(st.job.gateway_id for st in self.jobs.values())
        for lease in self.leases.by_request.values():  # one lease holds a prompt's KV for all its children
            held[lease.job.gateway_id] += len(lease.live)
        return dict(held)

    # ---- jobs ---------------------------------------------------------------------
    async def _on_job(self, job: PrefillJob, msg, ctx):
        """Validate and acknowledge at once; admission into the engine follows. The engine
        takes new requests only between steps, and a long prompt's step can outlast the
        gateway's wait for an acknowledgement, which would turn a busy worker into a 503."""
        max_n = min(MAX_N, self.rt.engine.cfg.max_num_seqs)
        if not 1 <= job.n <= max_n:
            return ErrorReply(f"n must be in [1, {max_n}] here, got {job.n}", "bad_request")
        if self._is_repeat(job):
            return Ack(worker_id=self.rt.worker_id)
        if self.rt.draining:
            return ErrorReply("worker is draining", "unavailable")
        try:
            params = job.sampling.to_params()
            self.rt.engine.check_request(job.prompt_ids, params)  # reads only fixed limits: safe off the engine thread
        except SamplingParamError as e:
            return ErrorReply(str(e), "bad_request")
        except RequestError as e:
            return ErrorReply(str(e), "bad_request")
        jobs = _children(job, params)
        if any(j.request_id in self.jobs for j in jobs):
            return ErrorReply(f"duplicate request id {job.request_id!r}", "bad_request")
        jobs = [j for j in jobs if j.request_id not in self.aborted]  # the client left while the job was on the way
        if not jobs:
            return ErrorReply("request was aborted", "bad_request")
        for j in jobs:
            span = self.rt.tracer.start_span("prefill", context=ctx, attributes={
                "request.id": j.request_id, "prompt.tokens": len(j.prompt_ids), "worker.id": self.rt.worker_id})
            queued_ns = time.time_ns()
            queue = self.rt.tracer.start_span("queue.wait", context=trace.set_span_in_context(span),
                                              start_time=queued_ns)
            self.jobs[j.request_id] = JobState(j, span, time.monotonic(), queue, queued_ns=queued_ns,
                                               parent=job.request_id if job.n > 1 else "")
        self.rt.spawn(self._admit(job, params, jobs), f"admit-{job.request_id}")
        return Ack(worker_id=self.rt.worker_id)

    def _is_repeat(self, job: PrefillJob) -> bool:
        """Whether this worker holds the very same job already (queued, computing, or
        computed and waiting for its pull). A gateway whose request for a job timed out
        sends it once more; across a NATS outage both copies are delivered when the link
        is back. The job runs once and the copy is acknowledged: refusing it as a duplicate
        failed the request with a 400 while its first copy ran for nobody."""
        for rid in [job.request_id] if job.n == 1 else fork_ids(job.request_id, job.n):
            st, lease = self.jobs.get(rid), self.leases.of(rid)
            first = st.job if st is not None else lease.job if lease is not None else None
            if first is not None:
                return first.gateway_id == job.gateway_id and first.prompt_ids == job.prompt_ids
        return False

    async def _admit(self, job: PrefillJob, params, jobs: list[PrefillJob]) -> None:
        rid = job.request_id
        cached: list[int] = []
        try:
            # A scored prompt computes every position here (engine/prompt_scores.py): nothing to pull.
            if job.kv_sources and self.rt.engine.cfg.enable_prefix_caching and params.prompt_logprobs is None:
                # A peer or the KV store holds more of this prompt than we do: pull it first.
                e = self.rt.engine
                usable = (len(job.prompt_ids) - 1) // e.cfg.block_size
                hashes = chain(job.prompt_ids, e.cfg.block_size, e.kv_identity, usable)
                cached = await self.rt.kv_sharing.acquire_prompt_prefix(hashes, job.kv_sources)
                if rid in self.jobs:
                    self.jobs[rid].span.set_attribute("prefill.cached_blocks", len(cached))

            def add(e) -> bool:
                # Runs on the engine thread, in order with aborts: a job aborted while its
                # prefix was being pulled is no longer in self.jobs and is never added.
                live = [j for j in jobs if j.request_id in self.jobs]
                if not live:
                    block_io.release(e, cached)
                    return False
                if job.n == 1:
                    e.add_request(rid, job.prompt_ids, params, cached_blocks=cached)
                else:
                    e.add_request(rid, job.prompt_ids, params, cached_blocks=cached,
                                  forks=[(j.request_id, j.sampling.to_params()) for j in live])
                return True

            await self.rt.loop.call(add)
        except Exception as e:
            if cached:
                await self.rt.loop.call(lambda eng: block_io.release(eng, cached))
            msg = str(e) if isinstance(e, RequestError) else f"prefill could not start: {type(e).__name__}: {e}"
            for j in jobs:
                st = self.jobs.pop(j.request_id, None)
                if st is None:
                    continue
                log.warning("prefill of %s could not start: %s", j.request_id, e)
                st.phase.end()
                st.span.set_status(trace.StatusCode.ERROR, str(e))
                st.span.end()
                self.rt.tokens.add(job.gateway_id, j.request_id, [], "error", msg)
            await self.rt.tokens.flush()

    async def _on_outputs(self, step: StepOutputs, stats: StepStats) -> None:
        rt = self.rt
        outputs = rt.engine.by_request(step)  # every row is a prompt's first token: few, and each one matters
        for rid in stats.scheduled:
            st = self.jobs.get(rid)
            if st is not None and not st.scheduled:
                st.scheduled = True
                # The step may have started before the job's span did (it arrived mid-step).
                t = st.scheduled_ns = max(start_time_ns(stats), st.queued_ns)
                st.phase.end(t)
                st.phase = self.rt.tracer.start_span(
                    "prefill.batch", context=trace.set_span_in_context(st.span), start_time=t,
                    attributes={"batch.num_tokens": stats.num_tokens, "batch.num_seqs": stats.num_seqs})
        held: dict[str, list[Handoff]] = {}  # by the job they move with (children of one prompt move as one)
        now = time.time()
        for out in outputs:
            st = self.jobs.pop(out.request_id, None)
            if st is None:
                continue
            job, span = st.job, st.span
            st.phase.end()
            self.m_prefill.observe(time.monotonic() - st.t0)
            if st.scheduled_ns:
                self.phases.record((st.scheduled_ns - st.queued_ns) / 1e9, now - st.scheduled_ns / 1e9)
            span.set_attribute("prefill.first_token", out.new_token_ids[0] if out.new_token_ids else -1)
            reason = out.finish_reason.value if out.finished else None
            rt.tokens.add(job.gateway_id, job.request_id, out.new_token_ids, reason,
                          logprobs=out.logprobs or None, position=out.position,
                          cached_tokens=out.num_cached_tokens if out.num_prompt_tokens else None,
                          prompt_logprobs=out.prompt_logprobs)
            if out.prefill_done:
                h = Handoff(job, span, None, list(out.new_token_ids), rt.engine.held_drafts(job.request_id))
                held.setdefault(st.parent or job.request_id, []).append(h)
            else:
                span.end()
        handoffs: dict[str, list[Handoff]] = {}  # decode worker -> what it is to pull
        for h, *forks in held.values():
            seq = rt.engine.held_sequence(h.job.request_id)
            n_blocks = fork_io.num_blocks(seq.num_prompt_tokens, 1 + len(forks), rt.engine.cfg.block_size) \
                if forks else rt.engine.blocks_for(seq.num_computed)
            h.lease = self.leases.grant(h.job, n_blocks, rt.kv_spec.nbytes(n_blocks, 1 + len(forks)),
                                        forks=[f.job.request_id for f in forks])
            h.forks = forks
            handoffs.setdefault(h.job.decode_id, []).append(h)
        await rt.tokens.flush()
        for decode_id, group in handoffs.items():
            rt.spawn(self._hand_off(decode_id, group, now), f"handoff-{decode_id}")

    async def _hand_off(self, decode_id: str, group: list["Handoff"], first_token_at: float) -> None:
        """Tell a decode worker that the KV of these requests (one step's, routed to it)
        is ready, in one message; its reply posts the receive, and the bytes go. If it has
        gone, or is draining, another live decode worker takes them instead."""
        rt = self.rt
        ready = KVReady(rt.worker_id, rt.transport.address, rt.kv_spec.wire, [
            KVReadyItem(h.job.request_id, h.job.prompt_ids, h.output_ids, h.job.sampling, h.job.gateway_id,
                        h.lease.lease_id, h.lease.num_blocks, h.lease.nbytes, traceparent_of(h.span), h.draft_ids,
                        [KVFork(f.job.request_id, f.output_ids, f.job.sampling, traceparent_of(f.span), f.draft_ids)
                         for f in h.forks])
            for h in group], self.cfg.lease_timeout_s, first_token_at)
        for h in group:
            h.lease.pulling = True  # held for the hand-off: an abort meanwhile frees it after
        others = [hb.worker_id for hb in self.peers.live("decode") if hb.worker_id != decode_id]
        err: Exception | None = None
        reply, taken_by = KVReadyReply(), None
        for candidate in [decode_id, *others]:
            if candidate != decode_id:
                # The gateway takes a request's tokens only from the workers it knows serve
                # it. Told on this worker's own token subject before the KVReady goes out, it
                # hears of the new decode worker before anything that worker sends.
                for h in group:
                    rt.tokens.hand_off(h.job.gateway_id, h.job.request_id, candidate)
                await rt.tokens.flush()
            try:
                reply = await request(rt.nc, rt.subjects.decode_kv_ready(candidate), ready, KVReadyReply,
                                      self.cfg.kv_ready_timeout_s)
                taken_by = candidate
                break
            except Unreachable as e:
                err = e
            except RemoteError as e:
                err = e
                if e.reply.code != "unavailable":
                    break
            log.warning("decode worker %s did not take %d requests: %s", candidate, len(group), err)
        send_error = await self._send(taken_by, reply, group) if taken_by is not None and reply.tag else None
        refused = reply.refused
        for h in group:
            for m in (h, *h.forks):
                rid = m.job.request_id
                if taken_by is not None and rid not in refused:
                    m.span.add_event("kv_ready_sent", {"decode.id": taken_by, "kv.bytes": h.lease.nbytes})
                    if send_error:
                        m.span.add_event("kv_send_failed", {"error": send_error})
                    m.span.end()
                    continue
                why = refused.get(rid) or f"decode worker {decode_id} unavailable: {err}"
                if why == ALREADY_SERVED:  # another copy of this job got there first: it is served
                    m.span.add_event("kv_ready_refused", {"reason": why})
                    m.span.end()
                    continue
                m.span.set_status(trace.StatusCode.ERROR, f"handoff failed: {why}")
                m.span.end()
                rt.tokens.add(m.job.gateway_id, rid, [], "error", why)
            self._free_lease_soon(h.job.request_id)  # sent, or nobody is to receive it
        await rt.tokens.flush()

    async def _send(self, decode_id: str, reply: KVReadyReply, group: list["Handoff"]) -> str | None:
        """The second leg: the bytes the reply posted a receive for. Returns None when
        sent, else why not (told to the decode worker, whose receive then fails at once)."""
        by_id = {h.job.request_id: h for h in group}
        try:
            if any(r not in by_id for r in reply.expect):
                raise TransferError(f"the reply expects requests this hand-off does not hold: {reply.expect}")
            spans = [self.rt.tracer.start_span("kv.send", context=extract_context({"traceparent": tp}),
                                               attributes={"request.id": r, "kv.bytes": by_id[r].lease.nbytes})
                     for r, tp in zip(reply.expect, reply.traceparents or [""] * len(reply.expect))]
            try:
                self.m_sent.inc(await self.sender.send(reply.address, reply.tag, [by_id[r].lease for r in reply.expect]))
            except TransferError as e:
                for sp in spans:
                    sp.set_status(trace.StatusCode.ERROR, str(e))
                raise
            finally:
                for sp in spans:
                    sp.end()
            return None
        except TransferError as e:
            log.warning("KV for %d requests not sent to %s: %s", len(reply.expect), decode_id, e)
            try:
                await publish(self.rt.nc, self.rt.subjects.decode_kv_failed(decode_id),
                              KVSendFailed(self.rt.worker_id, reply.tag, str(e)))
            except Exception as pe:  # the receive times out on its own
                log.debug("KVSendFailed not sent: %s", pe)
            return str(e)

    # ---- peers, leases ----------------------------------------------------------------
    async def _on_release(self, r: KVRelease, msg, ctx) -> Ack:
        if self.leases.get(r.request_id, r.lease_id) is not None:
            await self._free_lease(r.request_id)
        return Ack()

    async def _free_lease(self, request_id: str) -> None:
        fut = self._free_lease_soon(request_id)
        if fut is not None:
            await fut

    def _free_lease_soon(self, request_id: str):
        """Give the lease's blocks back (a future for when the engine has them)."""
        lease = self.leases.pop(request_id)
        if lease is None:
            return None
        ids = lease.request_ids
        fut = self.rt.loop.post(lambda e: [e.release(r) for r in ids], f"freeing the KV of {request_id}")
        e, kv = self.rt.engine, self.rt.kv_sharing
        # The prompt's blocks stay cached here: offer them to the KV store, if one beats.
        if e.cfg.enable_prefix_caching and kv.peers.live("kv_store"):
            kv.push_soon(chain(lease.job.prompt_ids, e.cfg.block_size, e.kv_identity))
        return fut

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.cfg.lease_timeout_s / 2))
            for lease in self.leases.expired():
                log.warning("lease on %s expired unpulled; freeing its KV", lease.job.request_id)
                self.m_expired.inc()
                await self._free_lease(lease.job.request_id)

    async def _gateway_gone(self, gateway_id: str) -> None:
        self.rt.tokens.forget(gateway_id)
        mine = {rid for rid, st in self.jobs.items() if st.job.gateway_id == gateway_id}
        mine |= {rid for lease in self.leases.by_request.values() if lease.job.gateway_id == gateway_id
                 for rid in lease.request_ids}
        if mine:
            await self._on_abort(Abort(sorted(mine), "gateway gone"), None, None)

    async def _on_abort(self, a: Abort, msg, ctx) -> None:
        for rid in a.request_ids:
            self.aborted.add(rid)  # its job may still be on the way
            lease = self.leases.of(rid)
            if lease is not None and not lease.pulling:
                lease.live.discard(rid)
                if not lease.live:  # the last of the requests whose KV it holds
                    await self._free_lease(lease.job.request_id)
            st = self.jobs.pop(rid, None)
            if st is not None:
                st.phase.end()
                st.span.add_event("aborted", {"reason": a.reason})
                st.span.end()
                await self.rt.loop.call(lambda e, r=rid: e.abort(r))


def _children(job: PrefillJob, params) -> list[PrefillJob]:
    """The requests a job stands for: itself, or its n children, each a job of its own."""
    if job.n == 1:
        return [job]
    return [replace(job, request_id=cid, sampling=WireSampling.from_params(fork_params(params, i)), n=1)
            for i, cid in enumerate(fork_ids(job.request_id, job.n))]
