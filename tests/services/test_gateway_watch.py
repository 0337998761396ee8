"""A worker's watch over the gateways: a gateway that falls silent has its requests
aborted soon enough that nothing runs for it 3 s after it died (issue 15's goal)."""

from __future__ import annotations

import asyncio
import time

from moemesh.shared.protocol.messages import Heartbeat, WorkerLoad
from moemesh.shared.service.gateway_watch import GatewayWatch


def _beat(gateway_id: str) -> Heartbeat:
    return Heartbeat(gateway_id, "gateway", "m", WorkerLoad(), interval_s=1.0)


def test_a_gateway_silent_for_two_beats_is_gone_within_a_moment():
    async def go() -> list[str]:
        gone: list[str] = []
        seen = asyncio.Event()

        async def on_gone(gateway_id: str) -> None:
            gone.append(gateway_id)
            seen.set()

        watch = GatewayWatch(on_gone)
        now = time.monotonic()
        # Its last beat 2.2 s ago (beats every 1 s; a gateway killed just after a beat is
        # 2.2 s dead): its requests must go now, not a second or two later.
        watch.registry.observe(_beat("gw-dead"), now=now - 2.2)
        watch.registry.observe(_beat("gw-live"), now=now)
        task = asyncio.create_task(watch.run())
        try:
            await asyncio.wait_for(seen.wait(), 0.6)
        finally:
            task.cancel()
        return gone

    assert asyncio.run(go()) == ["gw-dead"]


def test_nobody_is_gone_while_our_own_link_is_down():
    async def go() -> list[str]:
        gone: list[str] = []

        async def on_gone(gateway_id: str) -> None:
            gone.append(gateway_id)

        watch = GatewayWatch(on_gone)
        watch.registry.observe(_beat("gw"), now=time.monotonic() - 10)
        watch.registry.hold()
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.6)
        task.cancel()
        return gone

    assert asyncio.run(go()) == []
