"""Periodic liveness and load announcements, and the registry that listens to them."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from nats.aio.client import Client as NATS

from moemesh.shared.protocol.messages import Heartbeat
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.protocol.wire import encode

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


@dataclass
class LiveWorker:
    beat: Heartbeat
    last_seen: float  # monotonic


class WorkerRegistry:
    """Workers seen by heartbeat. A worker is forgotten when it has been silent for
    `miss_factor` of its own announced intervals (at least `min_timeout_s`)."""

    def __init__(self, miss_factor: float = 3.0, min_timeout_s: float = 2.0):
        self.workers: dict[str, LiveWorker] = {}
        self._miss = miss_factor
        self._min = min_timeout_s
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    def hold(self) -> None:
        """Our own NATS connection is down: nobody is silent because of it. No one is
        forgotten until `resume`."""
        self._held = True

    def resume(self, now: float | None = None) -> None:
        """The connection is back: every worker gets a fresh interval to be heard again."""
        now = time.monotonic() if now is None else now
        self._held = False
        for lw in self.workers.values():
            lw.last_seen = now

    def observe(self, hb: Heartbeat, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if hb.draining:
            self.workers.pop(hb.worker_id, None)
            return
        self.workers[hb.worker_id] = LiveWorker(hb, now)

    def prune(self, now: float | None = None) -> list[str]:
        if self._held:
            return []
        now = time.monotonic() if now is None else now
        dead = [w for w, lw in self.workers.items() if now - lw.last_seen > self._timeout(lw)]
        for w in dead:
            del self.workers[w]
        return dead

    def live(self, role: str | None, model: str | None = None) -> list[Heartbeat]:
        """Live workers of a role (None: every role). A silent worker is left out here but
        not forgotten: only prune() forgets, so that its caller hears of every death. (When
        this forgot them, a request or a /health call that came first made the gateway
        miss the death, and the dead worker's streams never moved.)"""
        now = time.monotonic()
        return [lw.beat for lw in self.workers.values()
                if (role is None or lw.beat.role == role) and (model is None or lw.beat.model == model)
                and (self._held or now - lw.last_seen <= self._timeout(lw))]

    def _timeout(self, lw: LiveWorker) -> float:
        return max(self._min, self._miss * lw.beat.interval_s)

    def get(self, worker_id: str) -> Heartbeat | None:
        lw = self.workers.get(worker_id)
        return lw.beat if lw else None
