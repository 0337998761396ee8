"""The KV store: KV blocks that outlive the requests that computed them.

Lifecycle of a block here: offered (KVPut from a worker; the store says which blocks
it lacks and posts a UCX receive) -> received (checksums verified; a bad block is
dropped) -> held in memory (LRU) -> spilled to disk when memory is full (if a disk tier
is set) -> evicted. Workers fetch blocks by hash over UCX (KVFetch), all or nothing; a
block that fails its checksum on the way out is a miss. Every change is published as
KVEvents, so the gateway can send a request's prefill where its context is.
"""

from __future__ import annotations

import logging
import zlib
from contextlib import AsyncExitStack

import numpy as np

from moemesh.services.kv_store.config import KVStoreConfig
from moemesh.services.kv_store.tiers import DiskTier, MemoryTier
from moemesh.shared.kv.events import KVEventPublisher
from moemesh.shared.protocol.messages import (
    Heartbeat,
    KVEvents,
    KVFetch,
    KVFetchReply,
    KVPut,
    KVPutReply,
    KVSnapshotRequest,
    StatsRequest,
    WorkerLoad,
    WorkerStats,
)
from moemesh.shared.protocol.prefix_hash import is_snapshot_key, snapshot_key
from moemesh.shared.protocol.registry import KVPeers, first_beat_wait_s
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.heartbeat import Heartbeater
from moemesh.shared.service.lifecycle import AsyncService
from moemesh.shared.service.metrics_http import MetricsServer
from moemesh.shared.service.nats_io import publish
from moemesh.shared.service.parts import Bus, TransportFactory, opened, ucx_transport
from moemesh.shared.service.tasks import TaskSet
from moemesh.shared.telemetry.metrics import Metrics
from moemesh.shared.transport.base import TransferError
from moemesh.shared.transport.staging import StagedReceive, StagingPool

log = logging.getLogger(__name__)


class KVStoreService(AsyncService):
    def __init__(self, cfg: KVStoreConfig, transport: TransportFactory | None = None):
        """transport: makes the KV transport (default UCX; tests give the loopback double)."""
        self.cfg = cfg
        self.id = cfg.worker_id
        self.subjects = Subjects(cfg.subject_prefix)
        self.mem = MemoryTier(cfg.capacity_mb << 20)
        self.disk = DiskTier(cfg.disk_dir, cfg.disk_capacity_mb << 20) if cfg.disk_dir else None
        self.peers = KVPeers()
        self.metrics = m = Metrics(const_labels={"model_name": cfg.model_name} if cfg.model_name else None)
        self.c_blocks = m.counter("kv_store_blocks_total", "fetch lookups by outcome", ("outcome",))
        self.c_bytes = m.counter("kv_store_transfer_bytes_total", "block bytes moved", ("direction",))
        self.c_evict = m.counter("kv_store_evictions_total", "blocks evicted", ("tier",))
        self.c_corrupt = m.counter("kv_store_corrupt_blocks_total", "blocks dropped for a bad checksum")
        self.g_used = m.gauge("kv_store_held_bytes", "bytes held", ("tier",))
        self.g_count = m.gauge("kv_store_held_blocks", "blocks held", ("tier",))
        for tier, t in (("memory", self.mem), ("disk", self.disk)):  # read at scrape time
            if t is not None:
                self.g_used.labels(tier).set_function(lambda t=t: t.used)
                self.g_count.labels(tier).set_function(lambda t=t: len(t))
        self.events = KVEventPublisher(lambda stored, removed: publish(
            self.nc, self.subjects.kv_events(self.id), KVEvents(self.id, "kv_store", b"*", stored, removed)))
        self._make_transport = transport or ucx_transport(cfg)
        self._tasks = TaskSet()
        self._stack: AsyncExitStack | None = None
        self.bus = Bus(cfg, f"moemesh-kv_store-{self.id}", self.subjects, self._tasks)
        self.transport = self.staging = self.heartbeat = self._http = None

    @property
    def nc(self):
        return self.bus.nc

    async def start(self) -> None:
        """Parts, entered in order (closed in reverse): transport, staging, bus, tasks,
        heartbeats, metrics server."""
        async with AsyncExitStack() as stack:
            await self._enter(stack)
            self._stack = stack.pop_all()

    async def _enter(self, stack: AsyncExitStack) -> None:
        cfg, s, bus = self.cfg, self.subjects, self.bus
        self.transport = await stack.enter_async_context(opened(self._make_transport()))
        self.staging = StagingPool(cfg.staging_mb << 20)
        await stack.enter_async_context(bus)
        await stack.enter_async_context(self._tasks)
        await bus.sub(s.heartbeat_all, Heartbeat, self._on_heartbeat)
        await bus.sub(s.kv_store_put, KVPut, self._on_put)
        # Concurrent: one fetch that waits (on a send, or for its fetcher's first beat)
        # holds up no other; staging memory bounds how many send at once.
        await bus.sub(s.kv_fetch(self.id), KVFetch, self._on_fetch, concurrent=True)
        await bus.sub(s.kv_snapshot(self.id), KVSnapshotRequest, self._on_snapshot)
        await bus.sub(s.stats(self.id), StatsRequest, self._on_stats)
        self._tasks.spawn(self.events.run(), "kv-events")
        self.heartbeat = await stack.enter_async_context(Heartbeater(self.nc, s, self._beat, cfg.heartbeat_interval_s))
        if cfg.metrics_port >= 0:
            self._http = await stack.enter_async_context(
                MetricsServer(self.metrics, lambda: {"status": "ok"}, cfg.metrics_host, cfg.metrics_port))
        # Blocks on disk from before a restart are announced again.
        self.events.add(_blocks(self.disk.hashes()) if self.disk else [])
        self.events.publish_soon()
        log.info("KV store %s ready: %d MiB memory, disk %s", self.id, cfg.capacity_mb, cfg.disk_dir or "off")

    async def drain(self) -> None:
        pass  # nothing is owed to anyone: a restart only costs recomputation

    async def stop(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    def _beat(self) -> Heartbeat:
        load = WorkerLoad(num_free_blocks=0, num_blocks=len(self.mem) + (len(self.disk) if self.disk else 0))
        return Heartbeat(self.id, "kv_store", self.cfg.model_name, load, address=self.transport.address,
                         kv_identity=b"*")

    async def _on_stats(self, req: StatsRequest, msg, ctx) -> WorkerStats:
        keys = self.mem.hashes() + (self.disk.hashes() if self.disk else [])
        snapshots = sum(map(is_snapshot_key, dict.fromkeys(keys)))
        counters = {"held_bytes_memory": self.mem.used, "held_bytes_disk": self.disk.used if self.disk else 0,
                    "held_blocks": len(set(keys)) - snapshots, "held_snapshots": snapshots,
                    **{f"blocks_{o}": self.c_blocks.labels(o)._value.get() for o in ("hit", "miss")}}
        return WorkerStats(self.id, "kv_store", self._beat().load, staging_bytes_used=self.staging.bytes_used,
                           counters=counters)

    async def _on_heartbeat(self, hb: Heartbeat, msg, ctx) -> None:
        self.peers.observe(hb)

    # ---- holding ----------------------------------------------------------------------------
    def has(self, h: bytes) -> bool:
        return h in self.mem or (self.disk is not None and h in self.disk)

    def _insert(self, h: bytes, data: bytes, crc: int) -> None:
        evicted = self.mem.put(h, data, crc)
        if evicted is None:
            return  # memory is all pinned right now: drop it, the worker still has it
        removed = []
        for old, d, c in evicted:
            if self.disk is not None:
                for gone in self.disk.put(old, d, c):
                    self.c_evict.labels("disk").inc()
                    removed.append(gone)
            else:
                removed.append(old)
            self.c_evict.labels("memory").inc()
        self.events.add(_blocks([h]), _blocks(removed))

    def _read(self, h: bytes) -> tuple[bytes, int] | None:
        got = self.mem.get(h)
        if got is None and self.disk is not None:
            got = self.disk.get(h)
            if got is None and self.disk.corrupt:
                self._sync_corrupt()
            elif got is not None:
                self._insert(h, *got)  # hot again: back to memory (what it evicts spills to disk)
        if got is not None and zlib.crc32(got[0]) != got[1]:
            self.c_corrupt.inc()
            return None
        return got

    def _sync_corrupt(self) -> None:
        self.c_corrupt.inc(self.disk.corrupt)
        self.disk.corrupt = 0

    # ---- the protocol -----------------------------------------------------------------------
    async def _on_put(self, p: KVPut, msg, ctx) -> KVPutReply:
        keys = _keys(p.hashes, p.snapshot_nbytes > 0)
        wanted = [not self.has(k) for k in keys]
        if not any(wanted):
            return KVPutReply(True, wanted=wanted)
        blocks_nbytes = p.nbytes - p.snapshot_nbytes
        if (not p.hashes or len(p.checksums) != len(keys) or p.snapshot_nbytes < 0 or blocks_nbytes <= 0
                or blocks_nbytes % len(p.hashes)):
            return KVPutReply(False, error="checksums and sizes do not match the offered blocks")
        rx = StagedReceive(self.transport, self.staging, p.nbytes)
        if rx.error:
            return KVPutReply(False, error="store staging memory is full")
        rx.post()
        self._tasks.spawn(self._receive(p, keys, wanted, rx), f"kv-receive-{rx.tag}")
        return KVPutReply(True, rx.tag, self.transport.address, wanted)

    async def _receive(self, p: KVPut, keys: list[bytes], wanted, rx: StagedReceive) -> None:
        try:
            await rx.wait(self.cfg.transfer_timeout_s)
            per = (p.nbytes - p.snapshot_nbytes) // len(p.hashes)
            raw = rx.slot.buffer()
            for i, (k, crc, want) in enumerate(zip(keys, p.checksums, wanted)):
                if not want:
                    continue
                data = bytes(raw[i * per : (i + 1) * per if i < len(p.hashes) else p.nbytes])
                if zlib.crc32(data) != crc:
                    self.c_corrupt.inc()  # damaged on the way in: never stored, never served
                    continue
                self._insert(k, data, crc)
            self.c_bytes.labels("in").inc(p.nbytes)
        except TransferError as e:
            log.info("blocks offered by %s never arrived: %s", p.holder_id, e)
        finally:
            rx.release()

    def _depth(self, f: KVFetch) -> int:
        """How many leading blocks of f.hashes can be served (V4: up to a snapshot)."""
        n = 0
        while n < len(f.hashes) and self.has(f.hashes[n]):
            n += 1
        while f.snapshot and n and not self.has(snapshot_key(f.hashes[n - 1])):
            n -= 1
        return n

    async def _on_fetch(self, f: KVFetch, msg, ctx) -> KVFetchReply:
        if f.depth_only:
            return KVFetchReply(True, num_blocks=self._depth(f))
        if not f.hashes or f.nbytes <= 0:
            return KVFetchReply(False, "bad block count or size")
        # A worker that just started may fetch before its first beat reached us.
        if not await self.peers.known_within(f.address, first_beat_wait_s(self.cfg.heartbeat_interval_s)):
            return KVFetchReply(False, "the fetching address belongs to no live worker")
        keys = _keys(f.hashes, f.snapshot)
        records = [self._read(k) for k in keys]
        held = [r for r in records if r is not None]
        blocks = held[: len(f.hashes)]
        if (len(held) != len(keys) or len({len(d) for d, _ in blocks}) != 1
                or sum(len(d) for d, _ in held) != f.nbytes):
            self.c_blocks.labels("miss").inc(len(f.hashes))
            return KVFetchReply(False, "not every block is held (or one failed its checksum, or the sizes differ)")
        for k in keys:
            self.mem.pin(k)
        slot = self.staging.alloc(f.nbytes)
        try:
            if slot is None:
                return KVFetchReply(False, "store staging memory is full")
            buf, at = slot.buffer(), 0
            for data, _ in held:
                buf[at : at + len(data)] = np.frombuffer(data, dtype=np.uint8)
                at += len(data)
            await self.transport.send(f.address, buf, f.tag, self.cfg.transfer_timeout_s)
            self.c_blocks.labels("hit").inc(len(f.hashes))
            self.c_bytes.labels("out").inc(f.nbytes)
            return KVFetchReply(True, checksums=[c for _, c in held])
        except TransferError as e:
            return KVFetchReply(False, str(e))
        finally:
            for k in keys:
                self.mem.unpin(k)
            if slot is not None:
                self.staging.free(slot)

    async def _on_snapshot(self, r: KVSnapshotRequest, msg, ctx) -> KVEvents:
        hashes = self.mem.hashes() + (self.disk.hashes() if self.disk else [])
        return KVEvents(self.id, "kv_store", b"*", _blocks(dict.fromkeys(hashes)), reset=True)


def _keys(hashes: list[bytes], snapshot: bool) -> list[bytes]:
    """The records a V4 move touches: its blocks, then the snapshot at their end."""
    return hashes + [snapshot_key(hashes[-1])] if snapshot and hashes else list(hashes)


def _blocks(keys) -> list[bytes]:
    """The keys that are blocks: snapshots are not announced, as no prompt's hash chain
    names them (a fetch asks for them by the block they end)."""
    return [k for k in keys if not is_snapshot_key(k)]
