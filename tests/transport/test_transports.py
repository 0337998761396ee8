"""Both transports against the same contract; UCX for real, two workers in one process."""

import asyncio

import numpy as np
import pytest

from moemesh.shared.transport.base import TransferError, TransferState
from moemesh.shared.transport.loopback import LoopbackHub, LoopbackTransport


async def _pair(kind):
    if kind == "loopback":
        hub = LoopbackHub()
        a, b = LoopbackTransport(hub), LoopbackTransport(hub)
        await a.start()
        await b.start()
        return a, b
    from moemesh.shared.transport.ucx import UcxTransport

    a, b = UcxTransport(), UcxTransport()
    await a.start()
    await b.start()
    return a, b


@pytest.mark.parametrize("kind", ["loopback", "ucx"])
def test_send_lands_in_the_posted_buffer(kind):
    async def go():
        a, b = await _pair(kind)
        try:
            for n in (8, 64 << 10, 4 << 20):
                src = np.arange(n, dtype=np.uint8)
                dst = np.zeros(n, dtype=np.uint8)
                tr = b.post_recv(dst, tag=1000 + n)
                assert tr.state == TransferState.WAITING_FOR_INPUT
                await a.send(b.address, src, 1000 + n, timeout=10)
                await tr.wait(10)
                assert tr.state == TransferState.SUCCESS and np.array_equal(src, dst)
        finally:
            await a.close()
            await b.close()

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
            await b.close()

    asyncio.run(go())


@pytest.mark.parametrize("kind", ["loopback", "ucx"])
def test_a_message_sent_before_its_receive_is_posted_is_kept_for_it(kind):
    async def go():
        a, b = await _pair(kind)
        try:
            src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20]
            await a.send(b.address, src, 4242, timeout=10)
            await asyncio.sleep(0.05)
            dst = np.zeros(1 << 20, dtype=np.uint8)
            await b.post_recv(dst, tag=4242).wait(10)
            assert np.array_equal(src, dst)
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_ucx_a_message_of_the_wrong_size_fails_its_receive_and_the_next_one_still_lands():
    async def go():
        a, b = await _pair("ucx")
        try:
            tr = b.post_recv(np.zeros(64, dtype=np.uint8), tag=9)
            await a.send(b.address, np.ones(100, dtype=np.uint8), 9, timeout=10)
            with pytest.raises(TransferError, match="expected 64 bytes"):
                await tr.wait(10)
            dst = np.zeros(64, dtype=np.uint8)
            tr = b.post_recv(dst, tag=10)
            await a.send(b.address, np.ones(64, dtype=np.uint8), 10, timeout=10)
            await tr.wait(10)
            assert dst.sum() == 64
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_ucx_bytes_that_arrive_after_their_receive_gave_up_never_touch_its_buffer():
    async def go():
        a, b = await _pair("ucx")
        try:
            dst = np.zeros(4096, dtype=np.uint8)
            tr = b.post_recv(dst, tag=31)
            with pytest.raises(TransferError, match="no data within"):
                await tr.wait(0.1)
            assert await tr.abandon(0.1)
            await a.send(b.address, np.ones(4096, dtype=np.uint8), 31, timeout=10)
            await asyncio.sleep(0.1)
            assert dst.sum() == 0
            assert 31 not in b._early and 31 not in b._abandoned  # taken and dropped
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


class _Probe:
    def __init__(self, tag, length):
        from ucxx.types import Tag

        self.matched, self.sender_tag, self.length = True, Tag(tag), length


class _Req:
    completed = False

    def check_error(self):
        pass


class _Worker:
    """Stands in for the UCX worker to hold a message between "arrived" and "landed"."""

    def __init__(self):
        self.arrivals, self.reqs = [], []

    def progress(self):
        pass

    def tag_probe(self, tag, mask, remove):
        return self.arrivals.pop(0) if self.arrivals else type("NoMatch", (), {"matched": False})()

    def tag_recv_with_handle(self, arr, probe):
        self.reqs.append(_Req())
        return self.reqs[-1]


def test_ucx_a_receive_posted_while_its_message_is_landing_still_gets_it():
    # The message arrives before its receive is posted, so it lands in memory of its own;
    # the receive is posted before that landing completes. It must not wait forever.
    pytest.importorskip("ucxx")
    from moemesh.shared.transport.ucx import UcxTransport

    async def go():
        import ucxx._lib.libucxx as api

        t = UcxTransport()
        t._api, t._worker = api, (w := _Worker())
        w.arrivals.append(_Probe(5, 8))
        assert t._take_arrivals()
        dst = np.zeros(8, dtype=np.uint8)
        tr = t.post_recv(dst, tag=5)
        t._inflight[0].sink[:] = np.arange(8, dtype=np.uint8)
        w.reqs[0].completed = True
        t._complete_receives()
        await tr.wait(1)
        assert list(dst) == list(range(8)) and not t._early

    asyncio.run(go())


def test_ucx_a_transport_that_waits_is_asleep():
    # A posted receive with nothing coming, and an idle transport beside it: neither may
    # spin. Progress runs on the worker's event fd (and a slow watchdog while a receive
    # is pending), so half a second of waiting costs a handful of drives, not thousands.
    async def go():
        a, b = await _pair("ucx")
        try:
            tr = b.post_recv(np.zeros(4096, dtype=np.uint8), tag=12)
            a0, b0 = a.num_drives, b.num_drives
            await asyncio.sleep(0.5)
            assert a.num_drives - a0 <= 2 and b.num_drives - b0 <= 6
            src = np.arange(4096, dtype=np.uint16).view(np.uint8)[:4096]
            await a.send(b.address, src, 12, timeout=10)
            await tr.wait(10)
            assert b.missed_wakeups == 0
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_ucx_large_messages_both_ways_at_once():
    async def go():
        a, b = await _pair("ucx")
        try:
            n = 8 << 20
            xs = [np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8) for i in range(4)]
            outs = [np.zeros(n, dtype=np.uint8) for _ in range(4)]
            trs = [b.post_recv(outs[0], 1), b.post_recv(outs[1], 2), a.post_recv(outs[2], 3), a.post_recv(outs[3], 4)]
            await asyncio.gather(a.send(b.address, xs[0], 1, 10), a.send(b.address, xs[1], 2, 10),
                                 b.send(a.address, xs[2], 3, 10), b.send(a.address, xs[3], 4, 10))
            for tr in trs:
                await tr.wait(10)
            assert all(np.array_equal(x, o) for x, o in zip(xs, outs))
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_ucx_a_peer_that_is_gone_costs_a_timeout_never_a_hang():
    async def go():
        a, b = await _pair("ucx")
        try:
            dst = np.zeros(1 << 20, dtype=np.uint8)
            tr = b.post_recv(dst, 3)
            await a.send(b.address, np.ones(1 << 20, dtype=np.uint8), 3, timeout=10)
            await tr.wait(10)
            await b.close()  # b stops progressing: a dead peer, as far as a can tell
            a.forget(b.address)  # closing the endpoint must not wait for b
            with pytest.raises(TransferError):  # unreachable, or at the latest the timeout
                await a.send(b.address, np.ones(1 << 20, dtype=np.uint8), 4, timeout=0.3)
        finally:
            await a.close()

    asyncio.run(asyncio.wait_for(go(), 20))


_SPIN_SIZES = [8, 4 << 10, 64 << 10, 1 << 20, 3 << 20]


def _spin_receiver(conn) -> None:
    """The other process: receives the test's messages, each under its tag into a
    buffer of its own, and reports a checksum of each."""
    from moemesh.shared.transport.ucx import UcxTransport

    async def go():
        t = UcxTransport(send_spin_us=0)
        await t.start()
        conn.send(t.address)
        sizes = _SPIN_SIZES * 4
        bufs = [np.zeros(n, np.uint8) for n in sizes]
        transfers = [t.post_recv(b, tag=700 + i) for i, b in enumerate(bufs)]
        for tr in transfers:
            await tr.wait(30)
        conn.send([int(b.astype(np.uint64).sum()) for b in bufs])
        conn.recv()  # the sender has finished with this address
        await t.close()

    asyncio.run(go())


@pytest.mark.parametrize("spin_us", [0.0, 400.0])
def test_ucx_sends_to_another_process_land_with_and_without_the_send_spin(spin_us):
    """The spin only changes how a send waits for its answer, never what lands: sends of
    every protocol size, one at a time and then in flight together, to a receiver in
    another process."""
    import multiprocessing as mp

    from moemesh.shared.transport.ucx import UcxTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_spin_receiver, args=(child,), daemon=True)
    proc.start()

    async def go():
        a = UcxTransport(send_spin_us=spin_us)
        await a.start()
        spins = []
        real = a._spin_sends
        a._spin_sends = lambda: (spins.append(1), real())
        try:
            assert parent.poll(60), "the receiver never started"
            peer = parent.recv()
            sizes = _SPIN_SIZES * 4
            srcs = [np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8) for i, n in enumerate(sizes)]
            half = len(sizes) // 2
            for i in range(half):  # one at a time
                await a.send(peer, srcs[i], 700 + i, timeout=30)
            await asyncio.gather(*(a.send(peer, srcs[i], 700 + i, timeout=30) for i in range(half, len(sizes))))
            assert parent.poll(60), "the receiver never reported"
            assert parent.recv() == [int(s.astype(np.uint64).sum()) for s in srcs]
            assert (len(spins) > 0) == (spin_us > 0) and not a._spinning
            parent.send("done")
        finally:
            await a.close()

    try:
        asyncio.run(go())
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_a_negative_send_spin_is_refused():
    from moemesh.shared.config.common import WorkerConfig

    with pytest.raises(ValueError, match="ucx_send_spin_us"):
        WorkerConfig(model="m", ucx_send_spin_us=-1)


def test_a_send_to_a_transport_of_this_process_never_spins():
    """Its answer needs this thread, which a spin would hold: the spin would only add
    its whole budget to every send."""
    from moemesh.shared.transport.ucx import UcxTransport

    async def go():
        a, b = UcxTransport(send_spin_us=400), UcxTransport(send_spin_us=400)
        await a.start()
        await b.start()
        spins = []
        real = a._spin_sends
        a._spin_sends = lambda: (spins.append(1), real())
        try:
            src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
            tr = b.post_recv(dst, tag=9)
            await a.send(b.address, src, 9, timeout=10)
            await tr.wait(10)
            assert np.array_equal(src, dst) and spins == []
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())
