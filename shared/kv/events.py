"""What a KV holder (engine worker or KV store) tells the mesh about its blocks.

- events: hashes of blocks that entered or left, batched over a few steps and published
  as KVEvents, so the gateway's KV index knows who holds which prefix;
- peers: the workers seen by heartbeat, and the one check before a UCX address given in
  a message is used: UCX aborts the process on a malformed address, so only addresses
  that live workers announced are ever connected to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Iterable

from moemesh.shared.protocol.registry import WorkerRegistry

log = logging.getLogger(__name__)
BATCH_S = 0.05  # the events of several steps go out as one message


class KVEventPublisher:
    def __init__(self, send: Callable[[list[bytes], list[bytes]], Awaitable[None]], batch_s: float = BATCH_S):
        """send(stored, removed): publishes one KVEvents message."""
        self._send, self._batch_s = send, batch_s
        self._stored: list[bytes] = []
        self._removed: list[bytes] = []
        self._flush = asyncio.Event()

    def add(self, stored: Iterable[bytes] = (), removed: Iterable[bytes] = ()) -> None:
        self._stored += stored
        self._removed += removed
        if self._stored or self._removed:
            self._flush.set()

    def publish_soon(self) -> None:
        """Publish even if nothing changed: a holder that starts announces itself."""
        self._flush.set()

    async def run(self) -> None:
        """Publish until cancelled."""
        while True:
            await self._flush.wait()
            self._flush.clear()
            stored, removed, self._stored, self._removed = self._stored, self._removed, [], []
            try:
                await self._send(stored, removed)
            except Exception as e:  # NATS reconnecting: a later snapshot request repairs the index
                log.debug("KV events not published: %s", e)
            await asyncio.sleep(self._batch_s)


def first_beat_wait_s(heartbeat_interval_s: float) -> float:
    """How long to wait for a worker's first beat before taking its address as unknown:
    two beats and a margin (a worker that just started may message before it beats)."""
    return 2 * heartbeat_interval_s + 0.5


class KVPeers(WorkerRegistry):
    def __init__(self, role: str | None = None):
        """role: the only role whose addresses count (None: any)."""
        super().__init__()
        self._role = role
        self._beat = asyncio.Event()

    def observe(self, hb, now: float | None = None) -> None:
        if self._role is not None and hb.role != self._role:
            return
        super().observe(hb, now)
        self._beat.set()  # wakes every waiter, then waits for the next beat
        self._beat.clear()

    def knows(self, address: bytes) -> bool:
        """Whether a live worker announced this UCX address."""
        return bool(address) and any(hb.address == address for hb in self.live(None))

    async def known_within(self, address: bytes, timeout_s: float) -> bool:
        """knows(address), waiting up to timeout_s for it: a worker that just started may
        not have beaten yet when its first message arrives."""
        deadline = time.monotonic() + timeout_s
        while not self.knows(address):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._beat.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True
