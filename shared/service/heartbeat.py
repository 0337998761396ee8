"""Periodic liveness and load announcements (the registry that listens to them:
shared/protocol/registry.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from nats.aio.client import Client as NATS

from moemesh.shared.protocol.messages import Heartbeat, encode
from moemesh.shared.protocol.subjects import Subjects

log = logging.getLogger(__name__)


class Heartbeater:
    """Publishes make_heartbeat() every interval until stopped; publish_now() for changes."""

    def __init__(self, nc: NATS, subjects: Subjects, make_heartbeat: Callable[[], Heartbeat], interval_s: float):
        self._nc, self._subjects, self._make, self._interval = nc, subjects, make_heartbeat, interval_s
        self._task: asyncio.Task | None = None

    async def publish_now(self) -> None:
        hb = self._make()
        hb.sent_at = time.time()
        hb.interval_s = self._interval
        try:
            await self._nc.publish(self._subjects.heartbeat(hb.role, hb.worker_id), encode(hb))
        except Exception as e:  # while NATS reconnects; the next beat will do
            log.debug("heartbeat not sent: %s", e)

    async def _run(self) -> None:
        while True:
            await self.publish_now()
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def __aenter__(self) -> "Heartbeater":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
