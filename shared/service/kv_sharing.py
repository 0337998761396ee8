"""A worker's cached KV blocks as a mesh resource.

- events: after every step, the hashes of blocks that entered or left the prefix cache
  are published (KVEvents), so the gateway knows which worker holds which prefix;
- snapshot: the full list on request (a gateway that starts late catches up);
- fetch: a peer asks for blocks by hash and gets them over UCX (all or nothing), with
  a crc32 per block (DeepSeek-V4: with the boundary snapshot at their end, block_io.py);
- pull: the other direction, for a prefill worker that was told a peer or the KV store
  holds more of a prompt than it does;
- push: finished requests' blocks are offered to the KV store in the background
  (DeepSeek-V4: up to the deepest boundary snapshot, with it).

A V4 prefix is usable only as deep as a boundary snapshot, which a holder's block hashes
do not show: before a V4 pull, the candidate holders are asked how deep they can serve
(KVFetch.depth_only), and the deepest is fetched, exactly that deep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from moemesh.shared.config.common import WorkerConfig
from moemesh.shared.engine import block_io
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.kv.events import KVEventPublisher
from moemesh.shared.kv.spec import KVSpec, compatible
from moemesh.shared.protocol.messages import (
    KVEvents, KVFetch, KVFetchReply, KVPut, KVPutReply, KVSnapshotRequest, KVSource,
)
from moemesh.shared.protocol.prefix_hash import snapshot_key
from moemesh.shared.protocol.registry import KVPeers, first_beat_wait_s
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.engine_loop import EngineLoop
from moemesh.shared.service.nats_io import RemoteError, Unreachable, publish, request
from moemesh.shared.service.parts import Bus
from moemesh.shared.service.tasks import TaskSet
from moemesh.shared.telemetry.metrics import Metrics
from moemesh.shared.transport.base import KVTransport, TransferError
from moemesh.shared.transport.staging import StagedReceive, StagingPool

log = logging.getLogger(__name__)
_PUSHED_MEMORY = 65536  # hashes remembered as already offered to the store
# A holder that did not serve a fetch is passed over for this long: a host gone silent
# costs the prompts already waiting on it, not every prompt until its heartbeats lapse.
HOLDER_TROUBLE_S = 10.0


@dataclass(frozen=True)
class KVParts:
    """The parts of a worker that KV sharing works with, once they are up."""
    cfg: WorkerConfig
    role: str
    engine: LLMEngine
    kv_spec: KVSpec
    loop: EngineLoop
    bus: Bus
    transport: KVTransport
    staging: StagingPool
    tasks: TaskSet

    @property
    def worker_id(self) -> str:
        return self.cfg.worker_id

    @property
    def nc(self):
        return self.bus.nc

    @property
    def subjects(self) -> Subjects:
        return self.bus.subjects

    def spawn(self, coro, name: str) -> asyncio.Task:
        return self.tasks.spawn(coro, name)


class PassedOver:
    """Holders that failed a fetch, each left out of fetches for `for_s` after its latest
    failure. Pure: the caller gives the time."""

    def __init__(self, for_s: float):
        self.for_s = for_s
        self._until: dict[str, float] = {}

    def note(self, holder: str, now: float) -> bool:
        """A fetch from holder failed at `now`; True if it was not passed over already."""
        fresh = not self.now(holder, now)
        self._until[holder] = now + self.for_s
        if len(self._until) > 1024:  # holders come and go: forget those long since asked again
            self._until = {h: t for h, t in self._until.items() if t > now}
        return fresh

    def now(self, holder: str, now: float) -> bool:
        return self._until.get(holder, 0.0) > now


class KVSharing:
    def __init__(self, parts: KVParts, metrics: Metrics):
        self.parts = p = parts
        self.spec = p.kv_spec
        self.peers = KVPeers()
        self.events = KVEventPublisher(lambda stored, removed: publish(
            p.nc, p.subjects.kv_events(p.worker_id), KVEvents(p.worker_id, p.role, self.spec.identity, stored, removed)))
        self._pushed: OrderedDict[bytes, None] = OrderedDict()
        self.pulled_tokens = 0  # prompt tokens whose KV came from a peer or the store
        self.pulls_failed = 0  # pulls given up (holder gone or silent, bad bytes): recomputed
        self.pull_wait_max_s = 0.0  # the longest a prompt waited on a holder, found or not
        self.passed_over = PassedOver(HOLDER_TROUBLE_S)
        m = metrics
        self.c_hit = m.counter("kv_prefix_tokens_total", "prompt tokens by where their KV came from", ("source",))
        self.c_bytes = m.counter("kv_share_bytes_total", "KV block bytes moved", ("direction",))

    async def start(self) -> None:
        p, s = self.parts, self.parts.subjects
        await p.bus.on_heartbeat(self.peers.observe)
        await p.bus.sub(s.kv_snapshot(p.worker_id), KVSnapshotRequest, self._on_snapshot)
        # Concurrent: one fetch that waits (on a send, or for its fetcher's first beat)
        # holds up no other; staging memory bounds how many send at once.
        await p.bus.sub(s.kv_fetch(p.worker_id), KVFetch, self._on_fetch, concurrent=True)
        p.spawn(self.events.run(), "kv-events")

    def _drain(self) -> None:
        """Hands on the block events not drained yet: a snapshot's, before it lists the
        cache (after every step, the worker's step accounting drains them into self.events)."""
        self.events.add(*self.parts.engine.drain_kv_events())

    async def _on_snapshot(self, req: KVSnapshotRequest, msg, ctx) -> KVEvents:
        def snap(e):
            self._drain()
            return e.cached_hashes()

        hashes = await self.parts.loop.call(snap)
        return KVEvents(self.parts.worker_id, self.parts.role, self.spec.identity, hashes, reset=True)

    # ---- serving peers --------------------------------------------------------------------
    async def _on_fetch(self, f: KVFetch, msg, ctx) -> KVFetchReply:
        p, spec = self.parts, self.spec
        why = "" if f.depth_only else spec.why_not_blocks(len(f.hashes), f.nbytes)
        if not why and f.layout is not None and not (c := compatible(spec, f.layout)):
            why = f"incompatible KV layout: {c.reason}"
        if why:
            return KVFetchReply(False, why)
        if f.depth_only:
            return KVFetchReply(True, num_blocks=await p.loop.call(lambda e: block_io.depth(e, f.hashes)))
        # A worker that just started may fetch before its first beat reached us.
        if not await self.peers.known_within(f.address, first_beat_wait_s(p.cfg.heartbeat_interval_s)):
            return KVFetchReply(False, "the fetching address belongs to no live worker")
        blocks = await p.loop.call(lambda e: block_io.acquire_exact(e, f.hashes))
        if blocks is None:
            return KVFetchReply(False, "not all blocks (V4: and the snapshot at their end) are cached here any more")
        slot = p.staging.alloc(f.nbytes)
        if slot is None:
            await p.loop.call(lambda e: block_io.release_exact(e, blocks, f.hashes))
            return KVFetchReply(False, "staging memory is full")
        try:
            out = slot.typed(spec.dtype, spec.block_shape(len(blocks)))
            # Referenced blocks and pinned snapshots are not written by steps: copy beside the
            # engine, not between steps.
            sums = await asyncio.to_thread(block_io.gather, p.engine, blocks, out, f.hashes)
            await p.loop.call(lambda e: block_io.release_exact(e, blocks, f.hashes))
            blocks = []
            await p.transport.send(f.address, slot.buffer(), f.tag, p.cfg.transfer_timeout_s)
            self.c_bytes.labels("sent").inc(f.nbytes)
            return KVFetchReply(True, checksums=sums)
        except TransferError as e:
            return KVFetchReply(False, str(e))
        finally:
            if blocks:
                await p.loop.call(lambda e: block_io.release_exact(e, blocks, f.hashes))
            p.staging.free(slot)

    # ---- pulling ----------------------------------------------------------------------------
    async def acquire_prompt_prefix(self, hashes: list[bytes], sources: list[KVSource]) -> list[int]:
        """Blocks holding the longest prefix of `hashes` we can get: our own cache first,
        then the best source. References are held; they go to the request."""
        p = self.parts
        local = await p.loop.call(lambda e: block_io.acquire_prefix(e, hashes))
        self.c_hit.labels("local").inc(len(local) * p.engine.cfg.block_size)
        # One deadline for everything asked of holders: a holder whose host went silent
        # (its NATS interest lingers until the cluster notices) costs a prompt at most
        # transfer_timeout_s, whatever the steps (a depth probe, the fetch, the bytes).
        t0 = time.monotonic()
        deadline = t0 + p.cfg.transfer_timeout_s
        try:
            best, n = await self._best_source(hashes, len(local), sources, deadline)
            if best is None:
                return local
            pulled = await self._pull(best, hashes[len(local) : n], len(local), deadline)
        finally:
            self.pull_wait_max_s = max(self.pull_wait_max_s, time.monotonic() - t0)
        if pulled:
            self.pulled_tokens += len(pulled) * p.engine.cfg.block_size
            self.c_hit.labels("remote").inc(len(pulled) * p.engine.cfg.block_size)
        return local + pulled

    async def _best_source(self, hashes: list[bytes], have: int, sources: list[KVSource],
                           deadline: float) -> tuple[str | None, int]:
        """The holder to pull from and how deep (in blocks of `hashes`) it serves."""
        p = self.parts
        now = time.monotonic()
        cands = [s for s in sources if s.num_blocks > have and s.holder_id != p.worker_id
                 and not self.passed_over.now(s.holder_id, now)]
        if not cands:
            return None, have
        if not self.spec.hybrid:
            best = max(cands, key=lambda s: s.num_blocks)
            return best.holder_id, min(best.num_blocks, len(hashes))
        missing = hashes[have : max(s.num_blocks for s in cands)]
        depths = await asyncio.gather(*(self._depth(s.holder_id, missing, deadline) for s in cands))
        d, holder = max(zip(depths, (s.holder_id for s in cands)))
        return (holder, have + d) if d else (None, have)

    async def _depth(self, holder: str, hashes: list[bytes], deadline: float) -> int:
        p = self.parts
        ask = KVFetch(hashes, p.transport.address, 0, 0, self.spec.wire, snapshot=True, depth_only=True)
        try:
            reply = await request(p.nc, p.subjects.kv_fetch(holder), ask, KVFetchReply, _left(deadline))
        except (Unreachable, RemoteError) as e:
            self._trouble(holder)
            log.info("asking %s how much of a prefix it holds failed: %s", holder, e)
            return 0
        return min(reply.num_blocks, len(hashes)) if reply.ok else 0

    async def _pull(self, holder: str, hashes: list[bytes], first_block: int, deadline: float) -> list[int]:
        p, spec = self.parts, self.spec
        new = await p.loop.call(lambda e: block_io.allocate(e, len(hashes)))
        if not new:
            return []
        rx = StagedReceive(p.transport, p.staging, spec.blocks_nbytes(len(hashes)))
        ok = False
        try:
            async def ask(tag: int) -> KVFetchReply:
                reply = await request(p.nc, p.subjects.kv_fetch(holder),
                                      KVFetch(hashes, p.transport.address, tag, rx.nbytes, spec.wire,
                                              snapshot=spec.hybrid), KVFetchReply,
                                      _left(deadline))
                if not reply.ok:
                    raise TransferError(reply.error)
                return reply

            reply = await rx.run(ask, _left(deadline))
            buf = rx.slot.typed(spec.dtype, spec.block_shape(len(hashes)))
            if block_io.checksums(buf, spec.block_numel if spec.hybrid else 0, len(hashes)) != reply.checksums:
                raise TransferError("checksum mismatch: treating the blocks as a miss")
            await p.loop.call(lambda e: block_io.scatter_and_register(e, new, hashes, buf, first_block))
            self.c_bytes.labels("received").inc(rx.nbytes)
            ok = True
            return new
        except (TransferError, Unreachable, RemoteError) as e:
            self._trouble(holder)
            log.info("pulling %d blocks from %s failed (%s); recomputing them", len(hashes), holder, e)
            return []
        finally:
            if not ok:
                await p.loop.call(lambda e: block_io.release(e, new))
            rx.release()

    def _trouble(self, holder: str) -> None:
        self.pulls_failed += 1
        if self.passed_over.note(holder, time.monotonic()):
            log.warning("passing over %s for prefix fetches for %.0f s", holder, HOLDER_TROUBLE_S)

    # ---- pushing to the store -----------------------------------------------------------------
    def store_id(self) -> str | None:
        stores = self.peers.live("kv_store")
        return stores[0].worker_id if stores else None

    def push_soon(self, hashes: list[bytes]) -> None:
        """Offer these full blocks to the KV store, in the background. Callers ask only
        when a store beats (peers.live("kv_store")), which is checked again here."""
        if not self.spec.hybrid:  # V4: which snapshot goes with them is known only in _push
            hashes = [h for h in hashes if h not in self._pushed]
        if hashes and self.store_id() is not None:
            self.parts.spawn(self._push(hashes), "kv-push")

    async def _push(self, hashes: list[bytes]) -> None:
        p, spec = self.parts, self.spec
        held = await p.loop.call(lambda e: block_io.acquire_deepest(e, hashes))
        if not held:
            return
        hashes = hashes[: len(held)]
        first, slot = 0, None
        try:
            if spec.hybrid:
                # The blocks not offered yet (at least the last, which names the snapshot), then
                # the snapshot at their end.
                first = next((i for i, h in enumerate(hashes) if h not in self._pushed), len(hashes) - 1)
                if first == len(hashes) - 1 and {hashes[-1], snapshot_key(hashes[-1])} <= self._pushed.keys():
                    return
            blocks, offered = held[first:], hashes[first:]
            slot = p.staging.alloc(spec.blocks_nbytes(len(blocks)))
            if slot is None:
                return
            buf = slot.typed(spec.dtype, spec.block_shape(len(blocks)))
            # The copy runs beside the engine, so offering blocks to the store never delays a step.
            sums = await asyncio.to_thread(block_io.gather, p.engine, blocks, buf, offered)
            await p.loop.call(lambda e: block_io.release_exact(e, held, hashes))
            held = []
            snap = spec.carry_numel * spec.dtype.itemsize if spec.hybrid else 0
            put = KVPut(p.worker_id, offered, sums, slot.nbytes, spec.identity, snapshot_nbytes=snap)
            reply = await request(p.nc, p.subjects.kv_store_put, put, KVPutReply, p.cfg.transfer_timeout_s)
            if reply.ok and any(reply.wanted) and self.peers.knows(reply.address):
                await p.transport.send(reply.address, slot.buffer(), reply.tag, p.cfg.transfer_timeout_s)
                self.c_bytes.labels("pushed").inc(slot.nbytes)
            for h in offered + ([snapshot_key(offered[-1])] if snap else []):
                self._pushed[h] = None
            while len(self._pushed) > _PUSHED_MEMORY:
                self._pushed.popitem(last=False)
        except (TransferError, Unreachable, RemoteError) as e:
            log.debug("KV push to the store failed: %s", e)  # the store is optional: recompute later
        finally:
            if held:
                await p.loop.call(lambda e: block_io.release_exact(e, held, hashes))
            if slot is not None:
                p.staging.free(slot)


def _left(deadline: float) -> float:
    """Seconds to a monotonic deadline; a step that starts after it still gets a moment,
    so that it fails as a timeout rather than never being asked."""
    return max(0.01, deadline - time.monotonic())
