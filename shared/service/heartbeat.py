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

PRUNE_EVERY_S = 0.1
# A suspect (see WorkerRegistry.suspect) is dead after this many of its intervals without a
# beat: less than miss_factor, since something else already said it is gone, and more than
# one, so that a live worker's next beat still comes in time.
SUSPECT_MISS_FACTOR = 1.5
# A beat that arrives within this part of an interval after the suspicion was already on its
# way (sent before the worker went): it clears nothing. A live worker's next one does.
SUSPECT_CLEAR_AFTER = 0.5

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
    suspect_since: float | None = None  # monotonic; None: nothing but its beats speaks of it


class WorkerRegistry:
    """Workers seen by heartbeat. A worker is forgotten when it has been silent for
    `miss_factor` of its own announced intervals (at least `min_timeout_s`), or for
    SUSPECT_MISS_FACTOR of them once it is suspect.

    owner_prunes: the owner acts on every death (the gateway moves the dead worker's
    requests), so only its own prune() calls forget anyone; live() then leaves the silent
    out without forgetting them, where it would otherwise swallow deaths the owner never
    hears of."""

    def __init__(self, miss_factor: float = 3.0, min_timeout_s: float = 2.0, owner_prunes: bool = False):
        self.workers: dict[str, LiveWorker] = {}
        self._miss = miss_factor
        self._min = min_timeout_s
        self._owner_prunes = owner_prunes
        self._pruned_at = 0.0
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
        old = self.workers.get(hb.worker_id)
        since = old.suspect_since if old is not None else None
        if since is not None and now - since >= SUSPECT_CLEAR_AFTER * old.beat.interval_s:
            since = None  # sent after it was found gone: it is back
        self.workers[hb.worker_id] = LiveWorker(hb, now, since)

    def suspect(self, worker_id: str, now: float | None = None) -> bool:
        """Something besides its heartbeats says the worker is gone: a request to it found
        no responder, or a transfer to or from it failed. From now on live() leaves it out
        (it gets no new work), and it is dead after SUSPECT_MISS_FACTOR of its intervals
        without a beat. A beat it sends after this clears the suspicion.

        While held, nothing is suspect: a request fails then because our own link is down.

        Returns:
            True when it is newly suspect (a known worker that was not already).
        """
        lw = self.workers.get(worker_id)
        if lw is None or lw.suspect_since is not None or self._held:
            return False
        lw.suspect_since = time.monotonic() if now is None else now
        return True

    def is_suspect(self, worker_id: str) -> bool:
        lw = self.workers.get(worker_id)
        return lw is not None and lw.suspect_since is not None

    def _timeout(self, lw: LiveWorker) -> float:
        t = max(self._min, self._miss * lw.beat.interval_s)
        return t if lw.suspect_since is None else min(t, SUSPECT_MISS_FACTOR * lw.beat.interval_s)

    def prune(self, now: float | None = None) -> list[str]:
        """Forget the workers silent for too long; returns their ids."""
        if self._held:
            return []
        now = time.monotonic() if now is None else now
        dead = [w for w, lw in self.workers.items() if now - lw.last_seen > self._timeout(lw)]
        for w in dead:
            del self.workers[w]
        return dead

    def live(self, role: str | None, model: str | None = None, now: float | None = None) -> list[Heartbeat]:
        """Live workers of a role (None: every role): heard from in time, and not suspect."""
        now = time.monotonic() if now is None else now
        if not self._owner_prunes and now - self._pruned_at > PRUNE_EVERY_S:
            # asked once per request: a sweep each time adds up
            self._pruned_at = now
            self.prune(now)
        held = self._held
        return [lw.beat for lw in self.workers.values()
                if lw.suspect_since is None and (held or now - lw.last_seen <= self._timeout(lw))
                and (role is None or lw.beat.role == role) and (model is None or lw.beat.model == model)]

    def get(self, worker_id: str) -> Heartbeat | None:
        lw = self.workers.get(worker_id)
        return lw.beat if lw else None
