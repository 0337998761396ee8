"""Who is alive, by heartbeat: the registry of live workers every part that needs one
keeps (the gateway's, a worker's known KV peers, a DEP instance's ranks). Pure state over
Heartbeat messages, no I/O: below the services and the data plane, so both build on it.
KVPeers is the registry a KV holder keeps of the workers whose UCX addresses it may use.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from moemesh.shared.protocol.messages import Heartbeat

PRUNE_EVERY_S = 0.1
# A beat that arrives within this part of an interval after the suspicion was already on its
# way (sent before the worker went): it clears nothing. A live worker's next one does.
SUSPECT_CLEAR_AFTER = 0.5


@dataclass
class LiveWorker:
    beat: Heartbeat
    last_seen: float  # monotonic
    suspect_since: float | None = None  # monotonic; None: nothing but its beats speaks of it
    gone: bool = False  # known dead (nothing subscribed to its subjects): forgotten at the next prune
    unsubscribed_since: float | None = None  # monotonic; a probe first found nothing subscribed


class WorkerRegistry:
    """Workers seen by heartbeat. A worker is forgotten when it has been silent for
    `miss_factor` of its own announced intervals (at least `min_timeout_s`), or at once
    when its owner learns it is gone (`confirm_gone`).

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
        self._ticked: float | None = None

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

    def tick(self, max_gap_s: float, now: float | None = None) -> float:
        """The owner's sweep, which runs at least every max_gap_s. A longer gap since the last
        one means the owner itself was not running (stopped, its event loop held): the beats
        sent meanwhile wait unread in its socket, so nobody is silent because of it. Every
        worker then gets a fresh interval, as after an outage of our own link.
        Returns the gap when it was one (0.0 otherwise)."""
        now = time.monotonic() if now is None else now
        last, self._ticked = self._ticked, now
        if last is None or now - last <= max_gap_s:
            return 0.0
        for lw in self.workers.values():
            lw.last_seen = now
        return now - last

    def observe(self, hb: Heartbeat, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if hb.draining or hb.leaving:
            self.workers.pop(hb.worker_id, None)
            return
        old = self.workers.get(hb.worker_id)
        since = old.suspect_since if old is not None else None
        if since is not None and now - since >= SUSPECT_CLEAR_AFTER * old.beat.interval_s:
            since = None  # sent after it was found gone: it is back
        self.workers[hb.worker_id] = LiveWorker(hb, now, since)

    def suspect(self, worker_id: str, now: float | None = None) -> bool:
        """Something besides its heartbeats says the worker may be gone: a request to it
        went unanswered, or a transfer to or from it failed. From now on live() leaves it out
        (it gets no new work). A slow worker is suspect too, so this alone kills nothing:
        `confirm_gone` does. A beat it sends after this clears the suspicion.

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

    def unsubscribed(self, worker_id: str, now: float | None = None) -> float | None:
        """A probe found nothing subscribed to the worker's subjects. Returns how long that
        has been so (0.0 the first time; None for a worker not known). A worker whose NATS
        node died has no subscriptions until it reaches another node of the cluster, so the
        owner waits a while before it takes this for death; a beat the worker sends clears
        it (`observe`)."""
        lw = self.workers.get(worker_id)
        if lw is None:
            return None
        now = time.monotonic() if now is None else now
        if lw.unsubscribed_since is None:
            lw.unsubscribed_since = now
        return now - lw.unsubscribed_since

    def confirm_gone(self, worker_id: str) -> bool:
        """The worker is dead for certain (e.g. nothing is subscribed to its subjects: the NATS
        server dropped its connection when the process died). Forgotten at the next prune,
        unless a beat it sent after this comes first. Returns True when newly known."""
        lw = self.workers.get(worker_id)
        if lw is None or lw.gone or self._held:
            return False
        lw.gone = True
        return True

    def silent(self, intervals: float, suspect_intervals: float, now: float | None = None) -> list[str]:
        """Workers not known gone, silent for more than `intervals` of their intervals (a
        suspect: `suspect_intervals`); nobody while held."""
        if self._held:
            return []
        now = time.monotonic() if now is None else now
        return [w for w, lw in self.workers.items() if not lw.gone and now - lw.last_seen >
                (intervals if lw.suspect_since is None else suspect_intervals) * lw.beat.interval_s]

    def _timeout(self, lw: LiveWorker) -> float:
        return 0.0 if lw.gone else max(self._min, self._miss * lw.beat.interval_s)

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


def first_beat_wait_s(heartbeat_interval_s: float) -> float:
    """How long to wait for a worker's first beat before taking its address as unknown:
    two beats and a margin (a worker that just started may message before it beats)."""
    return 2 * heartbeat_interval_s + 0.5


class KVPeers(WorkerRegistry):
    """The workers seen by heartbeat, and the one check before a UCX address given in a
    message is used: UCX aborts the process on a malformed address, so only addresses
    that live workers announced are ever connected to."""

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
