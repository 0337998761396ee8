"""The gateway's own link to NATS, as a new request's job sees it.

While the link is down, a job cannot reach any worker, and a request that times out says
nothing about the worker it was sent to. Just after the link comes back, the workers may
not have re-subscribed yet (each reconnects on its own), so "nobody there" says nothing
either. A job therefore waits for the link, and a failed send is tried again, instead of
being a 503 and a suspect worker, until the link has been steady for `settle_s` or the
request's wait runs out (GatewayConfig.nats_outage_wait_s).
"""

from __future__ import annotations

import asyncio
import time


class LinkState:
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
