"""What a KV holder (engine worker or KV store) tells the mesh about its blocks: hashes of
blocks that entered or left, batched over a few steps and published as KVEvents, so the
gateway's KV index knows who holds which prefix. (The peers whose UCX addresses a holder
may connect to are KVPeers, in shared/protocol/registry.py.)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Iterable

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
