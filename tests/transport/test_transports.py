"""Both transports against the same contract; UCX for real, within one process."""

import asyncio

import numpy as np
import pytest

from shared.transport.base import TransferError, TransferState
from shared.transport.loopback import LoopbackHub, LoopbackTransport


async def _pair(kind):
    if kind == "loopback":
        hub = LoopbackHub()
        a, b = LoopbackTransport(hub), LoopbackTransport(hub)
        await a.start()
        await b.start()
        return a, b
    from shared.transport.ucx import UcxTransport

    t = UcxTransport()
    await t.start()
    return t, t  # one ucxx context per process: the worker sends to itself


@pytest.mark.parametrize("kind", ["loopback", "ucx"])
def test_send_lands_in_the_posted_buffer(kind):
    async def go():
        a, b = await _pair(kind)
        try:
            for n in (8, 64 << 10, 4 << 20):
                src = np.arange(n, dtype=np.uint8)
                dst = np.zeros(n, dtype=np.uint8)
                tr = b.post_recv(dst, tag=1000 + n)
                assert tr.state == TransferState.PENDING
                await a.send(b.address, src, 1000 + n, timeout=10)
                await tr.wait(10)
                assert tr.state == TransferState.DONE and np.array_equal(src, dst)
        finally:
            await a.close()

    asyncio.run(go())


@pytest.mark.parametrize("kind", ["loopback", "ucx"])
def test_a_receive_that_never_gets_data_times_out_and_frees_its_buffer(kind):
    async def go():
        a, b = await _pair(kind)
        try:
            dst = np.zeros(1024, dtype=np.uint8)
            tr = b.post_recv(dst, tag=77)
            with pytest.raises(TransferError, match="no data within"):
                await tr.wait(0.3)
            assert await tr.abandon(0.1)
        finally:
            await a.close()

    asyncio.run(go())
