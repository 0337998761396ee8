"""The gateway's side of the control plane: who is alive, where a request goes, and
the token streams coming back.

Each admitted request gets a Handle (stream.py). Token batches from workers (one per
worker step) are decoded once, and each row's ids are appended to its handle, which
wakes the request's reader if it waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict

from nats.aio.client import Client as NATS

from moemesh.services.gateway.config import GatewayConfig
from moemesh.services.gateway.kv_index import KVIndex
from moemesh.services.gateway.router import pick_decode, pick_prefill
from moemesh.services.gateway.stream import Handle, sweep_inactive
from moemesh.shared.protocol.prefix_hash import chain
from moemesh.shared.protocol.messages import (
    Abort, Ack, Heartbeat, KVEvents, KVSnapshotRequest, KVSource, PrefillJob, TokenBatch, WireSampling,
)
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.heartbeat import WorkerRegistry
from moemesh.shared.service.nats_io import RemoteError, Unreachable, connect, disconnect, publish, request, subscribe
from moemesh.shared.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


class NoWorkers(RuntimeError):
    pass


class Rejected(RuntimeError):
    """A worker refused the request (bad parameters it caught, or draining)."""


class MeshClient:
    def __init__(self, cfg: GatewayConfig, gateway_id: str | None = None):
        self.cfg = cfg
        self.gateway_id = gateway_id or cfg.worker_id or f"gw-{uuid.uuid4().hex[:8]}"
        self.subjects = Subjects(cfg.subject_prefix)
        self.registry = WorkerRegistry()
        self.handles: dict[str, Handle] = {}
        self._assigned: dict[str, int] = defaultdict(int)
        self._assigned_prompt: dict[str, int] = defaultdict(int)
        self.kv = KVIndex()
        self._snapshots: set[str] = set()
        self.nc: NATS | None = None
        self._subs = []
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        self.nc = await connect(self.cfg, f"moemesh-gateway-{self.gateway_id}")
        s = self.subjects
        self._subs.append(await subscribe(self.nc, s.heartbeat_all, Heartbeat, self._on_heartbeat))
        self._subs.append(await subscribe(self.nc, s.gateway_tokens(self.gateway_id), TokenBatch, self._on_tokens))
        self._subs.append(await subscribe(self.nc, s.kv_events, KVEvents, self._on_kv_events))
        self._sweeper = asyncio.create_task(sweep_inactive(self.handles, self.cfg.inactivity_timeout_s),
                                            name="inactivity-sweep")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self.nc is None:
            return
        nc, self.nc = self.nc, None
        await disconnect(nc)

    # ---- workers ---------------------------------------------------------------------
    async def _on_heartbeat(self, hb: Heartbeat, msg, ctx) -> None:
        self.registry.observe(hb)
        self._assigned.pop(hb.worker_id, None)  # the beat now reflects what we sent
        self._assigned_prompt.pop(hb.worker_id, None)
        if hb.kv_identity and hb.worker_id not in self._snapshots and not hb.draining:
            self._snapshots.add(hb.worker_id)  # catch up on what it held before we listened
            asyncio.get_running_loop().create_task(self._snapshot(hb.worker_id))
        for dead in self.registry.prune():
            self.kv.forget(dead)
            self._snapshots.discard(dead)

    async def _snapshot(self, holder: str) -> None:
        try:
            ev = await request(self.nc, self.subjects.kv_snapshot(holder), KVSnapshotRequest(), KVEvents, 5)
            self.kv.apply(ev)
        except (Unreachable, RemoteError) as e:
            self._snapshots.discard(holder)  # try again on a later heartbeat
            log.debug("KV snapshot of %s failed: %s", holder, e)

    async def _on_kv_events(self, ev: KVEvents, msg, ctx) -> None:
        self.kv.apply(ev)

    def _route_prefill(self, prompt_ids: list[int]) -> tuple[Heartbeat | None, list[KVSource]]:
        """KV-aware: the prefill worker by router.pick_prefill, plus the holders (peers, the
        KV store) that have a longer prefix of this prompt than it, to pull from."""
        workers = self.live("prefill")
        if not workers:
            return None, []
        chains: dict[tuple[bytes, int], list[bytes]] = {}
        overlap: dict[str, int] = {}
        holders = [hb for hb in self.registry.live(None) if hb.kv_identity and self.kv.knows(hb.worker_id)]
        workers_ = [hb for hb in holders if hb.role != "kv_store"]
        for hb in workers_:
            key = (hb.kv_identity, hb.block_size)
            if key not in chains:
                usable = (len(prompt_ids) - 1) // hb.block_size
                chains[key] = chain(prompt_ids, hb.block_size, hb.kv_identity, usable)
            overlap[hb.worker_id] = self.kv.overlap(hb.worker_id, chains[key])
        block_size = workers[0].block_size or 16
        chosen = pick_prefill(workers, overlap, block_size, self._assigned_prompt)
        mine = overlap.get(chosen.worker_id, 0)
        ident = (chosen.kv_identity, chosen.block_size)
        mine_chain = chains.get(ident)
        if mine_chain is None:
            return chosen, []
        for hb in holders:  # a store holds blocks of any model: the hashes themselves tell
            if hb.role == "kv_store":
                overlap[hb.worker_id] = self.kv.overlap(hb.worker_id, mine_chain)
        sources = sorted((KVSource(hb.worker_id, overlap[hb.worker_id]) for hb in holders
                          if overlap.get(hb.worker_id, 0) > mine and hb.worker_id != chosen.worker_id
                          and (hb.role == "kv_store" or (hb.kv_identity, hb.block_size) == ident)),
                         key=lambda s: -s.num_blocks)[:2]
        return chosen, sources

    def live(self, role: str) -> list[Heartbeat]:
        return self.registry.live(role)

    # ---- requests --------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     headers: dict | None) -> Handle:
        decode = pick_decode(self.live("decode"), self._assigned)
        if decode is None:
            raise NoWorkers("no decode worker is alive")
        if not self.cfg.decode_only_bench and not self.live("prefill"):
            raise NoWorkers("no prefill worker is alive")
        h = Handle(request_id, decode.worker_id, asyncio.get_running_loop().time())
        self.handles[request_id] = h
        self._assigned[decode.worker_id] += params.max_tokens
        job = PrefillJob(request_id, list(prompt_ids), WireSampling.from_params(params), self.gateway_id,
                         decode.worker_id, time.time())
        if self.cfg.decode_only_bench:
            subject = self.subjects.decode_bench_job(decode.worker_id)
        else:
            prefill, job.kv_sources = self._route_prefill(prompt_ids)
            subject = self.subjects.prefill_direct(prefill.worker_id)
            self._assigned_prompt[prefill.worker_id] += len(prompt_ids)
        try:
            try:
                await request(self.nc, subject, job, Ack, self.cfg.prefill_timeout_s, headers)
            except Unreachable:
                if self.cfg.decode_only_bench:
                    raise
                # The chosen worker just went away: any prefill worker will do.
                job.kv_sources = []
                await request(self.nc, self.subjects.prefill_jobs, job, Ack, self.cfg.prefill_timeout_s, headers)
        except Unreachable as e:
            self.handles.pop(request_id, None)
            raise NoWorkers(f"no prefill worker took the request: {e}") from None
        except RemoteError as e:
            self.handles.pop(request_id, None)
            if e.reply.code == "unavailable":
                raise NoWorkers(str(e)) from None
            raise Rejected(e.reply.error) from None
        return h

    async def _on_tokens(self, batch: TokenBatch, msg, ctx) -> None:
        handles, rids = self.handles, batch.request_ids
        now = asyncio.get_running_loop().time()
        if batch.counts is None:  # the common case: one id per row
            for rid, t in zip(rids, batch.token_ids):
                h = handles.get(rid)
                if h is not None:
                    h.ids.append(t)
                    h.last_seen = now
                    h.wake()
        else:
            i = 0
            for rid, n in zip(rids, batch.counts):
                h = handles.get(rid)
                if h is not None and n:
                    h.ids += batch.token_ids[i : i + n]
                    h.last_seen = now
                    h.wake()
                i += n
        for e in batch.ends:
            h = handles.get(rids[e.row])
            if h is not None:
                h.last_seen = now
                h.end(e)

    def finish(self, request_id: str) -> None:
        self.handles.pop(request_id, None)

    async def abort(self, request_id: str, reason: str = "client") -> None:
        self.handles.pop(request_id, None)
        if self.nc is not None:
            try:
                await publish(self.nc, self.subjects.abort, Abort([request_id], reason))
            except Exception as e:
                log.warning("abort for %s not sent: %s", request_id, e)

    def abort_soon(self, request_id: str, reason: str = "client") -> None:
        """From a cancelled context (a client that went away), where awaiting is not possible."""
        asyncio.get_running_loop().create_task(self.abort(request_id, reason))
