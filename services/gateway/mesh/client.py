"""The gateway's side of the control plane, and all of its NATS I/O: who is alive (heartbeats),
which KV blocks they hold (KV events and snapshots), sending a request's job, the token
streams coming back, and aborts.

Routing policy is not here: routing/router.py chooses the workers from what this client knows.

A request's job goes to the prefill worker router.route_prefill chose, on that worker's
own subject, with the holders its worker may pull cached blocks from. When nobody
answers there (the worker just went away, or did not reply within prefill_timeout_s),
the job goes once more, without KV sources, to the prefill queue group, where any
prefill worker may take it. In decode-only bench mode it goes straight to the chosen
decode worker, with no fallback.

Each admitted request gets a Handle (streaming/choices.py), which owns its stream and its end.
Token batches from workers (one per worker step) are decoded once, and each row's ids
are appended to its handle, which wakes the request's reader if it waits. A row is taken
only from a worker that serves its request: the prefill worker it went to, the decode
worker it was handed to (the gateway's choice, or the one its prefill worker named in a
hand-off notice), in the request's current migration attempt.

A worker is suspect, and gets no new requests, from the moment a request to it finds
nobody there or its prefill worker could not hand KV to it; if its heartbeats stop too,
it is dead sooner than by its heartbeats alone, and its requests move (migration.py,
which the client owns: the watch of silent workers, probes, drains, and the moves).
When the reader closes the handle, the request is forgotten here and, if it was aborted, the
abort goes out to the workers from a tracked task.

The client's own link to NATS (LinkState): while it is down, a job cannot reach any
worker, and a request that times out says nothing about the worker it was sent to. Just
after the link comes back, the workers may not have re-subscribed yet (each reconnects on
its own), so "nobody there" says nothing either. A job therefore waits for the link, and
a failed send is tried again, instead of being a 503 and a suspect worker, until the link
has been steady for `settle_s` or the request's wait runs out
(GatewayConfig.nats_outage_wait_s).

A request of n > 1 is one job (its prompt is prefilled once) and n handles, one per
choice, under the ids the workers give its children (protocol/forks.py): each is a
stream of its own from then on, with its own end, abort, resends and migration.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from dataclasses import replace

from nats.aio.client import Client as NATS

from moemesh.services.gateway.config import GatewayConfig
from moemesh.services.gateway.mesh.migration import Migration, NoWorkers, Rejected
from moemesh.services.gateway.routing.router import KVIndex, pick_decode, route_prefill
from moemesh.services.gateway.streaming.choices import GAP, REFUSED, Choices, Handle, sweep_inactive
from moemesh.shared.protocol.messages import (
    Abort, Ack, Heartbeat, KVEvents, KVSnapshotRequest, PrefillJob, SamplingParams, TokenBatch, TokenEnd, TokenResend,
    WireSampling, WorkerLoad,
)
from moemesh.shared.protocol.forks import fork_ids, fork_params
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.protocol.registry import WorkerRegistry
from moemesh.shared.service.heartbeat import Heartbeater
from moemesh.shared.service.nats_io import (
    LinkEvents, RemoteError, Unreachable, connect, disconnect, publish, request, subscribe,
)
from moemesh.shared.service.tasks import TaskSet
from moemesh.shared.telemetry.metrics import Metrics

log = logging.getLogger(__name__)
# What a client is told when a worker fails its request. The worker's own text (which can
# name subjects, workers and transfers) is logged with the request id instead.
CLIENT_ERROR = "the request failed while it was being served"
RESEND_EVERY_S = 0.5
SILENT_S = 2.0  # a stream this long without a batch: its workers are asked what it missed


class LinkState:
    """The gateway's own link to NATS, as a new request's job sees it (see above)."""

    def __init__(self, settle_s: float):
        self.settle_s = settle_s
        self._up = asyncio.Event()
        self.epoch = 0  # outages so far: a send that spans one sees it change
        self._back_at = -1e9

    def on_up(self) -> None:
        """Back after an outage: the workers may not have re-subscribed yet."""
        self._back_at = time.monotonic()
        self._up.set()

    def on_connected(self) -> None:
        """The first connection: the workers that beat are subscribed already."""
        self._up.set()

    def on_down(self) -> None:
        self.epoch += 1
        self._up.clear()

    @property
    def is_up(self) -> bool:
        return self._up.is_set()

    async def wait_up(self, deadline: float) -> bool:
        """True once the link is up; False if it is still down at deadline (monotonic)."""
        if self._up.is_set():
            return True
        try:
            await asyncio.wait_for(self._up.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return False
        return True

    def steady_since(self, epoch: int) -> bool:
        """The link stayed up through a send begun at `epoch` and had settled before it:
        a failure then is the peer's, not the link's."""
        return self._up.is_set() and self.epoch == epoch and time.monotonic() - self._back_at >= self.settle_s


class MeshClient:
    def __init__(self, cfg: GatewayConfig, gateway_id: str | None = None, metrics: Metrics | None = None):
        self.cfg = cfg
        m = metrics or Metrics()
        self.c_gaps = m.counter("token_gaps_total", "token rows that arrived after a gap in their stream")
        self.c_resends = m.counter("token_resends_total", "streams a worker was asked to send again")
        self.c_migrations = m.counter("request_migrations_total", "requests resubmitted because their worker died")
        self.c_refused = m.counter("token_rows_refused_total",
                                   "token rows dropped because their sender does not serve their request")
        self._refused_from: set[str] = set()  # senders already logged
        self.gateway_id = gateway_id or cfg.worker_id or f"gw-{uuid.uuid4().hex[:8]}"
        self.subjects = Subjects(cfg.subject_prefix)
        # Silent for silent_worker_limit beats, or found gone by a probe: its streams move
        # (migration). Only the watch forgets workers, so that every death moves its streams.
        self.registry = WorkerRegistry(miss_factor=cfg.silent_worker_limit, min_timeout_s=1.0, owner_prunes=True)
        # DEP instances a rank left (its peer died): down until a rank of it beats again,
        # which a restarted instance only does once all its ranks have met.
        self.instances_down: dict[str, tuple[str, float]] = {}  # instance -> (why, unix time it went)
        self.g_down = m.gauge("dep_instances_down", "DEP instances that lost a rank and have not come back")
        self.handles: dict[str, Handle] = {}
        # Requests whose job is on its way and not yet taken: _send_job's own fallbacks see
        # them through a worker's death, and a migration then would send a second job.
        self._sending: set[str] = set()
        self._assigned: dict[str, int] = defaultdict(int)
        self._assigned_prompt: dict[str, int] = defaultdict(int)
        self.kv = KVIndex()
        self._snapshots: set[str] = set()
        self.nc: NATS | None = None
        self._subs = []
        self._tasks = TaskSet()  # KV snapshots, aborts, the inactivity sweep
        self._sweeper: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._heartbeat: Heartbeater | None = None
        self._leaving = False
        # Workers re-subscribe within a beat or two of the server coming back.
        self.link = LinkState(settle_s=max(2.0, 2 * cfg.heartbeat_interval_s))
        self.migration = Migration(self.registry, self.subjects, self._tasks, self.handles, self._sending,
                                   cfg.max_migrations, self.c_migrations, self._send_job,
                                   lambda rid, why: self._send_abort(self.nc, rid, why), self._forget,
                                   lambda: self.nc)

    async def start(self) -> None:
        link = LinkEvents()
        link.down += [self.registry.hold, self.link.on_down]
        link.up += [self.registry.resume, self.link.on_up, self._recover]
        self.nc = await connect(self.cfg, f"moemesh-gateway-{self.gateway_id}", link)
        self.link.on_connected()
        s = self.subjects
        self._subs.append(await subscribe(self.nc, s.heartbeat_all, Heartbeat, self._on_heartbeat))
        self._subs.append(await subscribe(self.nc, s.gateway_tokens(self.gateway_id, "*"), TokenBatch, self._on_tokens))
        self._subs.append(await subscribe(self.nc, s.kv_events("*"), KVEvents, self._on_kv_events))
        self._watcher = self._tasks.spawn(self.migration.watch(), "worker-watch")
        self._sweeper = self._tasks.spawn(sweep_inactive(self.handles, self.cfg.inactivity_timeout_s,
                                                         silent_s=SILENT_S, on_silent=self.ask_resend),
                                          "inactivity-sweep")
        # Workers watch these: when a gateway falls silent, they abort its requests.
        self._heartbeat = Heartbeater(self.nc, s, self._beat, self.cfg.heartbeat_interval_s)
        self._heartbeat.start()

    def _beat(self) -> Heartbeat:
        return Heartbeat(self.gateway_id, "gateway", self.cfg.model_name, WorkerLoad(num_running=len(self.handles)),
                         draining=self._leaving)

    async def close(self) -> None:
        """Safe to call twice. Aborts already on their way get a moment to go out."""
        if self._heartbeat is not None:  # leaving on purpose: workers need not abort anything
            await self._heartbeat.stop()
            self._leaving = True
            await self._heartbeat.publish_now()
            self._heartbeat = None
        # The loops never end on their own: left in the set, they would hold close() for
        # its whole grace, which is for the aborts and resends still going out.
        for loop in (self._sweeper, self._watcher):
            if loop is not None:
                loop.cancel()
        self._sweeper = self._watcher = None
        await self._tasks.close(grace_s=1.0)
        if self.nc is None:
            return
        nc, self.nc = self.nc, None
        await disconnect(nc)

    # ---- workers ---------------------------------------------------------------------
    async def _on_heartbeat(self, hb: Heartbeat, msg, ctx) -> None:
        self.registry.observe(hb)
        if hb.leaving and hb.role in ("prefill", "decode"):
            self.migration.left(hb.worker_id)
            if hb.dp_size > 1:  # an instance short of a rank cannot step: none of its ranks gets work
                self.instances_down[hb.instance_id] = (f"rank {hb.worker_id} left", hb.sent_at)
                self.g_down.set(len(self.instances_down))
                for w, lw in list(self.registry.workers.items()):
                    if lw.beat.instance_id == hb.instance_id:
                        self.migration.suspect(w, f"rank {hb.worker_id} of its instance left")
            return
        if hb.instance_id in self.instances_down and hb.started_at > self.instances_down[hb.instance_id][1]:
            del self.instances_down[hb.instance_id]  # restarted: its ranks met again
            self.g_down.set(len(self.instances_down))
        self.migration.beat(hb.worker_id, hb.draining and hb.role in ("prefill", "decode"), hb.interval_s)
        self._assigned.pop(hb.worker_id, None)  # the beat now reflects what we sent
        self._assigned_prompt.pop(hb.worker_id, None)
        if hb.kv_identity and hb.worker_id not in self._snapshots and not hb.draining:
            self._snapshots.add(hb.worker_id)  # catch up on what it held before we listened
            self._tasks.spawn(self._snapshot(hb.worker_id), f"kv-snapshot-{hb.worker_id}")
        self.migration.check()

    def _forget(self, worker_id: str) -> None:
        """A gone worker's blocks are no longer anywhere to be found."""
        self.kv.forget(worker_id)
        self._snapshots.discard(worker_id)

    async def _snapshot(self, holder: str) -> None:
        try:
            ev = await request(self.nc, self.subjects.kv_snapshot(holder), KVSnapshotRequest(), KVEvents, 5)
            self.kv.apply(ev)
        except (Unreachable, RemoteError) as e:
            self._snapshots.discard(holder)  # try again on a later heartbeat
            log.debug("KV snapshot of %s failed: %s", holder, e)
            if isinstance(e, Unreachable):
                self.migration.suspect(holder, "its KV snapshot went unanswered")

    async def _on_kv_events(self, ev: KVEvents, msg, ctx) -> None:
        self.kv.apply(ev)

    def live(self, role: str) -> list[Heartbeat]:
        return self.registry.live(role)

    # ---- requests --------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     headers: dict | None) -> Handle:
        h = Handle(request_id, "", self._closed, asyncio.get_running_loop().time())
        h.prompt_ids, h.params, h.headers = prompt_ids, params, headers
        try:
            await self._send_job(h, prompt_ids, params)
        except asyncio.CancelledError:  # the client went away; the job may have been taken
            h.close("client")
            raise
        except BaseException:
            h.close()
            raise
        return h

    async def submit_choices(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                             headers: dict | None, n: int) -> Choices:
        """A request of n > 1: one job, and a handle per child the workers fork it into."""
        if self.cfg.decode_only_bench:
            raise Rejected("n > 1 needs a prefill: it is not served in decode-only bench mode")
        now = asyncio.get_running_loop().time()
        hs = [Handle(cid, "", self._closed, now) for cid in fork_ids(request_id, n)]
        for i, h in enumerate(hs):
            h.prompt_ids, h.params, h.headers = prompt_ids, fork_params(params, i), headers
        try:
            await self._send_job(hs[0], prompt_ids, params, (request_id, hs))
        except asyncio.CancelledError:
            for h in hs:
                h.close("client")
            raise
        except BaseException:
            for h in hs:
                h.close()
            raise
        return Choices(hs)

    async def submit_batch(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                           headers: dict | None, n: int) -> Choices:
        """A completion's batch of prompts: each a request of its own (of n choices, under
        <request_id>-p<k>), their handles read as one, prompt after prompt. One that cannot
        be sent fails them all: those sent already are aborted."""
        handles: list[Handle] = []
        try:
            for k, ids in enumerate(prompts):
                rid = f"{request_id}-p{k}"
                if n == 1:
                    handles.append(await self.submit(rid, ids, params, headers))
                else:
                    handles += (await self.submit_choices(rid, ids, params, headers, n)).handles
        except BaseException:
            for h in handles:
                h.close("client")
            raise
        return Choices(handles)

    async def _send_job(self, h: Handle, prompt_ids: list[int], params: SamplingParams,
                        fork: tuple[str, list[Handle]] | None = None) -> None:
        """Choose the workers for h and send its job (raises NoWorkers or Rejected).
        fork: (job id, the handles of its children) for a request of n > 1; h is the first."""
        if self.cfg.decode_only_bench and params.prompt_logprobs is not None:
            raise Rejected("prompt logprobs come from a prefill: they are not served in decode-only bench mode")
        decode = pick_decode(self.live("decode"), self._assigned)
        if decode is None:
            raise NoWorkers("no decode worker is alive")
        if not self.cfg.decode_only_bench and not self.live("prefill"):
            raise NoWorkers("no prefill worker is alive")
        request_id, members = fork or (h.request_id, [h])
        for m in members:
            m.decode_id, m.prefill_id = decode.worker_id, ""
            self.handles[m.request_id] = m
        self._assigned[decode.worker_id] += params.max_tokens * len(members)
        job = PrefillJob(request_id, list(prompt_ids), WireSampling.from_params(params), self.gateway_id,
                         decode.worker_id, time.time(), n=len(members))
        if self.cfg.decode_only_bench:
            subject = self.subjects.decode_bench_job(decode.worker_id)
            h.next_pos = 1  # the worker makes up the first token (the prompt's last) and never sends it
        else:
            prefill, job.kv_sources = route_prefill(prompt_ids, self.live("prefill"), self.registry.live(None),
                                                    self.kv, self._assigned_prompt)
            subject = self.subjects.prefill_direct(prefill.worker_id)
            for m in members:
                m.prefill_id = prefill.worker_id
            self._assigned_prompt[prefill.worker_id] += len(prompt_ids)
        self._sending.add(request_id)
        deadline = time.monotonic() + self.cfg.nats_outage_wait_s
        try:
            try:
                await self._request_job(subject, job, h, deadline)
            except Unreachable as e:
                self.migration.suspect(h.prefill_id or h.decode_id, str(e))
                if self.cfg.decode_only_bench:
                    raise
                # The chosen worker just went away: any prefill worker will do.
                job.kv_sources = []
                for m in members:
                    m.prefill_id = ""
                ack = await self._request_job(self.subjects.prefill_jobs, job, h, deadline)
                for m in members:
                    m.prefill_id = ack.worker_id
        except Unreachable as e:
            log.warning("request %s: no prefill worker took it (%s)", request_id, e)
            raise NoWorkers("no prefill worker took the request") from None
        except RemoteError as e:
            # A worker's words name subjects and workers: they go to the log, and the
            # client gets the kind of failure only.
            log.warning("request %s: refused by a worker (%s)", request_id, e)
            if e.reply.code == "unavailable":
                raise NoWorkers("no worker can take the request now") from None
            raise Rejected("the request was refused by the serving workers") from None
        finally:
            self._sending.discard(request_id)

    async def _request_job(self, subject: str, job: PrefillJob, h: Handle, deadline: float) -> Ack:
        """Send a job and take its Ack, riding out an outage of our own NATS link (LinkState):
        a send that failed while the link was down or not yet settled goes again, until
        deadline. A job that got through but lost its Ack may arrive twice; workers run a
        repeated job once."""
        while True:
            if not await self.link.wait_up(deadline):
                raise Unreachable(f"NATS has been unreachable for {self.cfg.nats_outage_wait_s:g}s")
            epoch = self.link.epoch
            try:
                return await request(self.nc, subject, job, Ack, self.cfg.prefill_timeout_s, h.headers)
            except Unreachable:
                if self.link.steady_since(epoch) or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.25)

    def _recover(self) -> None:
        """Back from a NATS outage: what was sent meanwhile may be lost; ask for all of it."""
        self.migration.recover()
        for h in self.handles.values():
            h.asked_at = -1e9
        self.ask_resend(list(self.handles.values()))

    async def _on_tokens(self, batch: TokenBatch, msg, ctx) -> None:
        """One worker step's rows: each goes to its stream by Handle.put (whose rule says
        from whom and which ids), then the rows' ends, then the resends any gap needs."""
        now = asyncio.get_running_loop().time()
        if batch.handoffs:
            self._take_handoffs(batch)
        gaps: list[Handle] = []
        if batch.counts is None and not batch.ends and batch.positions:
            refused = self._take_steps(batch, now, gaps)
        else:
            took, refused = self._take_rows(batch, now, gaps)
            self._take_ends(batch, took, now)
        if gaps:
            self.c_gaps.inc(len(gaps))
            self.ask_resend(gaps)
        if refused:
            self._refuse(batch.worker_id, refused)

    def _take_steps(self, batch: TokenBatch, now: float, gaps: list[Handle]) -> int:
        """Most steps: one id per numbered row, and nothing ends. Returns the rows refused."""
        get, toks, pos, w = self.handles.get, batch.token_ids, batch.positions, batch.worker_id
        refused = 0
        for i, rid in enumerate(batch.request_ids):
            h = get(rid)
            if h is not None:
                new = h.put(w, toks, i, 1, pos[i], now)
                if new < 0:
                    if new == GAP:
                        gaps.append(h)
                    else:
                        refused += 1
        return refused

    def _take_rows(self, batch: TokenBatch, now: float, gaps: list[Handle]) -> tuple[dict[int, int], int]:
        """Rows of any count, numbered or not (a worker that does not number them: taken as
        they come). Returns (what put said of each row with an end, the rows refused)."""
        get, toks, counts, pos, w = self.handles.get, batch.token_ids, batch.counts, batch.positions, batch.worker_id
        ends = {e.row for e in batch.ends}
        took: dict[int, int] = {}
        refused = i = 0
        for row, rid in enumerate(batch.request_ids):
            n = 1 if counts is None else counts[row]
            h = get(rid)
            if h is not None:
                new = h.put(w, toks, i, n, pos[row] if pos else h.next_pos, now)
                if new < 0:
                    if new == GAP:
                        gaps.append(h)
                    else:
                        refused += 1
                if ends and row in ends:
                    took[row] = new
            i += n
        return took, refused

    def _take_ends(self, batch: TokenBatch, took: dict[int, int], now: float) -> None:
        """The ends of the rows taken. A row after a gap keeps its end back with its ids,
        for the resend; a numbered row sent again keeps the logprobs of its new ids only."""
        for e in batch.ends:
            h = self.handles.get(batch.request_ids[e.row])
            new = took.get(e.row, REFUSED)
            if h is None or new < 0:
                continue
            if batch.positions and e.logprobs and new < len(e.logprobs):
                e.logprobs = e.logprobs[len(e.logprobs) - new :] if new else None
            h.last_seen = now
            _end(h, e, batch.worker_id)

    def _take_handoffs(self, batch: TokenBatch) -> None:
        """A prefill worker handed these requests' KV to other decode workers than the
        ones chosen here (those did not answer it): their rows come from those now."""
        w, refused = batch.worker_id, 0
        for rid, decode_id in batch.handoffs.items():
            h = self.handles.get(rid)
            if h is None or h.decode_id == decode_id:
                continue
            if w != h.prefill_id:
                refused += 1
                continue
            old, h.decode_id = h.decode_id, decode_id
            self.migration.suspect(old, f"prefill worker {w} could not hand it a request")
        if refused:
            self._refuse(w, refused)

    def _refuse(self, worker_id: str, num_rows: int) -> None:
        """Rows from a worker that serves none of their requests: dropped, counted, and
        logged the first time that worker sends any."""
        self.c_refused.inc(num_rows)
        if worker_id not in self._refused_from:
            self._refused_from.add(worker_id)
            log.warning("dropped %d token rows from %s, which serves none of their requests (logged once per "
                        "sender; token_rows_refused_total counts them all)", num_rows, worker_id)

    def ask_resend(self, handles: list[Handle]) -> None:
        """Ask the workers serving these streams to send again from what each lacks (at
        most once per RESEND_EVERY_S a stream: a gap shows in every batch until it is filled)."""
        now = asyncio.get_running_loop().time()
        by_worker: dict[str, dict[str, int]] = defaultdict(dict)
        for h in handles:
            if h.closed or now - h.asked_at < RESEND_EVERY_S:
                continue
            h.asked_at = now
            for w in (h.prefill_id, h.decode_id):
                if w:
                    by_worker[w][h.request_id] = h.next_pos
        for worker, asks in by_worker.items():
            self.c_resends.inc(len(asks))
            r = TokenResend(self.gateway_id, list(asks), list(asks.values()))
            self._tasks.spawn(self._send_resend(worker, r), f"resend-{worker}")

    async def _send_resend(self, worker: str, r: TokenResend) -> None:
        try:
            await publish(self.nc, self.subjects.token_resend(worker), r)
        except Exception as e:  # NATS down: asked again when it is back, or when the stream stays silent
            log.info("asking %s to resend %d streams failed: %s", worker, len(r.request_ids), e)

    def _closed(self, request_id: str, abort: str | None) -> None:
        """A handle's close(): forget the request, and send its abort if it has one."""
        self.handles.pop(request_id, None)
        if abort is not None and self.nc is not None:
            self._tasks.spawn(self._send_abort(self.nc, request_id, abort), f"abort-{request_id}")

    async def _send_abort(self, nc: NATS, request_id: str, reason: str) -> None:
        try:
            await publish(nc, self.subjects.abort, Abort([request_id], reason))
        except Exception as e:  # NATS down: the workers' own timeouts end the request
            log.warning("abort for %s not sent: %s", request_id, e)


def _end(h: Handle, e: TokenEnd, worker_id: str) -> None:
    """End a stream; a worker's error text goes to the log, the client gets CLIENT_ERROR."""
    if e.error is not None:
        log.warning("request %s failed on %s: %s", h.request_id, worker_id, e.error)
        e = replace(e, error=CLIENT_ERROR)
    h.end(e)
