"""Gateways seen by heartbeat, from a worker's side. A gateway that falls silent (killed,
cut off) can no longer stream anything to its clients: the requests it sent are nobody's,
and a worker that kept running them would spend its batch on them. When one goes, the
worker aborts what it holds for it. A gateway that announces a drain is let go without
that: it ends its own requests."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from moemesh.shared.protocol.messages import Heartbeat
from moemesh.shared.protocol.registry import WorkerRegistry

log = logging.getLogger(__name__)
# Silent for two of its beats (at least 1 s): gone, as the gateway judges workers. Checked
# every CHECK_EVERY_S, so at the default 1 s beat a dead gateway's requests are aborted
# within about 2.25 s of its last beat: nothing runs for it 3 s after it died. (Three
# beats and a check once a beat left them running for up to 4 s.)
MISS_FACTOR = 2.0
MIN_SILENCE_S = 1.0
CHECK_EVERY_S = 0.25
PAUSED_AFTER_S = 1.0  # a check this late: this process was stopped, not the gateways silent


class GatewayWatch:
    def __init__(self, on_gone: Callable[[str], Awaitable[None]], check_every_s: float = CHECK_EVERY_S):
        self._on_gone, self._every = on_gone, check_every_s
        self.registry = WorkerRegistry(miss_factor=MISS_FACTOR, min_timeout_s=MIN_SILENCE_S)

    def observe(self, hb: Heartbeat) -> None:
        if hb.role == "gateway":
            self.registry.observe(hb)

    async def run(self) -> None:
        """Check for silent gateways until cancelled."""
        while True:
            await asyncio.sleep(self._every)
            paused = self.registry.tick(max(PAUSED_AFTER_S, 4 * self._every))
            if paused:
                log.warning("this worker did not run for %.1fs (stopped, or its event loop held): no gateway "
                            "is judged by the beats it could not read meanwhile", paused)
                continue
            for gateway_id in self.registry.prune():
                log.warning("gateway %s stopped sending heartbeats: aborting its requests", gateway_id)
                await self._on_gone(gateway_id)
