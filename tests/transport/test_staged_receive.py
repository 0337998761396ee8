"""The staged receive: polled states, and staging memory given back on every failure,
only once nothing can land in it any more."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from moemesh.shared.transport import staging
from moemesh.shared.transport.base import Transfer, TransferError, TransferState
from moemesh.shared.transport.loopback import LoopbackHub, LoopbackTransport
from moemesh.shared.transport.staging import StagedReceive, StagingPool

N = 4096


async def _pair():
    hub = LoopbackHub()
    a, b = LoopbackTransport(hub), LoopbackTransport(hub)
    await a.start()
    await b.start()
    return a, b


def test_bytes_arrive_through_the_states_and_release_frees_the_staging():
    async def go():
        a, b = await _pair()
        pool = StagingPool(1 << 20)
        rx = StagedReceive(b, pool, N)
        assert rx.state == TransferState.BOOTSTRAPPING and pool.bytes_used >= N
        src = np.arange(N, dtype=np.uint16).view(np.uint8)[:N]
        states = []

        async def ask(tag):
            states.append(rx.state)
            await a.send(b.address, src, tag, 1)
            return "sent"

        assert await rx.run(ask, 1) == "sent"
        assert states == [TransferState.WAITING_FOR_INPUT] and rx.state == TransferState.SUCCESS
        assert np.array_equal(rx.slot.buffer(), src)
        rx.release()
        rx.release()
        assert pool.bytes_used == 0

    asyncio.run(go())


def test_full_staging_fails_at_once():
    async def go():
        _, b = await _pair()
        pool = StagingPool(1024)
        rx = StagedReceive(b, pool, N, "decode")
        assert rx.state == TransferState.FAILED and "decode staging memory full" in rx.error
        with pytest.raises(TransferError, match="staging memory full"):
            await rx.run(lambda tag: asyncio.sleep(0), 1)
        assert not b._posted and pool.bytes_used == 0

    asyncio.run(go())


def test_a_timeout_abandons_the_receive_and_late_bytes_never_land():
    async def go():
        a, b = await _pair()
        pool = StagingPool(1 << 20)
        rx = StagedReceive(b, pool, N)
        slot = rx.slot

        async def ask(tag):
            return tag

        with pytest.raises(TransferError, match="no data within"):
            await rx.run(ask, 0.05)
        assert rx.state == TransferState.FAILED and "no data within" in rx.error
        assert pool.bytes_used == 0 and not b._posted
        await a.send(b.address, np.ones(N, dtype=np.uint8), rx.tag, 1)
        assert slot.tensor.sum() == 0  # kept aside as an early arrival, not written into freed staging

    asyncio.run(go())


def test_a_refused_ask_frees_the_staging():
    async def go():
        _, b = await _pair()
        pool = StagingPool(1 << 20)
        rx = StagedReceive(b, pool, N)

        async def ask(tag):
            raise TransferError("prefill worker refused the pull: gone")

        with pytest.raises(TransferError, match="refused"):
            await rx.run(ask, 1)
        assert rx.state == TransferState.FAILED and "refused" in rx.error
        assert pool.bytes_used == 0 and not b._posted

    asyncio.run(go())


def test_cancelling_the_waiter_frees_the_staging():
    async def go():
        _, b = await _pair()
        pool = StagingPool(1 << 20)
        rx = StagedReceive(b, pool, N)
        rx.post()
        t = asyncio.create_task(rx.wait(10))
        await asyncio.sleep(0.01)
        assert rx.state == TransferState.WAITING_FOR_INPUT
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert rx.state == TransferState.FAILED and pool.bytes_used == 0 and not b._posted

    asyncio.run(go())


class _Landing:
    """A transport whose bytes are landing and cannot be called back."""

    address = b"landing"

    def __init__(self):
        self.fut = None

    def post_recv(self, buf, tag):
        self.fut = asyncio.get_running_loop().create_future()
        return Transfer(self.fut, len(buf), try_cancel=lambda: False, landing=lambda: True)


def test_a_failure_while_bytes_land_frees_the_staging_only_once_they_have_landed():
    async def go():
        t, pool = _Landing(), StagingPool(1 << 20)
        rx = StagedReceive(t, pool, N)
        rx.post()
        assert rx.state == TransferState.TRANSFERRING
        rx.fail("the pull timed out")
        assert rx.state == TransferState.FAILED and rx.error == "the pull timed out"
        assert pool.bytes_used >= N  # still being written
        t.fut.set_result(None)
        await asyncio.sleep(0)
        assert pool.bytes_used == 0

    asyncio.run(go())


def test_the_ask_and_the_bytes_share_one_timeout(monkeypatch):
    """A slow answer leaves the bytes what is left of the timeout, not a timeout of their own.
    On the receive's own clock, which the ask moves on by 0.25 s: a real sleep of 0.2 s
    could end a little before 0.2 s had passed on it (the loop's timers round to the
    millisecond), and the test failed by that once."""
    clock = SimpleNamespace(now=1000.0)
    clock.monotonic = lambda: clock.now
    monkeypatch.setattr(staging, "time", clock)

    async def go():
        a, b = await _pair()
        rx = StagedReceive(b, StagingPool(1 << 20), N)
        given = []

        async def wait(timeout):
            given.append(timeout)
            raise TransferError("no bytes")

        rx.wait = wait

        async def slow_ask(tag):
            clock.now += 0.25
            return "asked"

        with pytest.raises(TransferError):
            await rx.run(slow_ask, 1.0)
        assert given == [0.75]
        rx.release()

    asyncio.run(go())
