"""services/gateway/mesh/client.py, LinkState: when a failed job send is the link's fault, not the worker's."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from moemesh.services.gateway.mesh import client
from moemesh.services.gateway.mesh.client import LinkState


def test_a_send_counts_against_the_worker_only_on_a_settled_link(monkeypatch):
    # The link's own clock, moved by hand: on the wall clock a stall of 0.2 s between
    # on_up() and the check after it would read as a settled link.
    clock = SimpleNamespace(now=1000.0, time=time.time)
    clock.monotonic = lambda: clock.now
    monkeypatch.setattr(client, "time", clock)
    link = LinkState(settle_s=0.2)
    assert not link.is_up
    link.on_connected()
    epoch = link.epoch
    assert link.steady_since(epoch)  # at start the workers that beat are subscribed
    link.on_down()
    assert not link.steady_since(epoch)  # the send spanned an outage
    link.on_up()
    assert not link.steady_since(link.epoch)  # back, but the workers may not be re-subscribed
    clock.now += 0.19
    assert not link.steady_since(link.epoch)
    clock.now += 0.01
    assert link.steady_since(link.epoch) and not link.steady_since(epoch)


def test_waiting_for_the_link_ends_when_it_is_back_or_at_the_deadline():
    async def go():
        link = LinkState(settle_s=1.0)
        link.on_connected()
        link.on_down()
        t0 = time.monotonic()
        gave_up = await link.wait_up(t0 + 0.1)
        asyncio.get_running_loop().call_later(0.05, link.on_up)
        came_back = await link.wait_up(time.monotonic() + 5)
        return gave_up, came_back, time.monotonic() - t0

    gave_up, came_back, took = asyncio.run(go())
    assert (gave_up, came_back) == (False, True) and took < 2
