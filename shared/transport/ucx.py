"""UCX data plane (ucxx), set up for the fast path measured on this project:

- endpoints are made from UCX worker addresses that peers exchange over NATS, never
  through a listener;
- endpoint error handling is off, which keeps shared-memory transports eligible
  (with it on, UCX falls back to TCP: 20-40x slower);
- progress runs in "blocking" mode on the asyncio loop (an epoll fd), not a thread;
- receives land in staging memory allocated once (see staging.py).

A receive is not posted up front. One loop probes for whatever message has arrived,
under any tag, and receives it (tag_probe + recv_with_handle): into the buffer of the
receive waiting for that tag, or, when none waits, into memory of its own that a later
post_recv takes over (or that is dropped after its receiver gave up). So a receive that
times out leaves nothing behind in UCX that could later write into memory already
handed to someone else, and one probe per round serves every pending receive.

ucxx keeps one context per process, so one UcxTransport per process: its loop takes
every tagged message the worker receives.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from shared.transport.base import Transfer, TransferError

log = logging.getLogger(__name__)

# Probe interval while receives wait: short enough that a 1 MiB transfer (tens of us on
# shared memory) is not dominated by the wait, long enough not to spin the event loop.
_MIN_POLL_S = 10e-6
_MAX_POLL_S = 200e-6
# Right after a receive is posted or a message lands, the next message is usually a
# moment away (the rest of a pull, or the sender's next block), and a timer cannot wake
# the loop sooner than the selector's millisecond resolution. So for this long the loop
# yields without a timer instead, then falls back to the growing interval.
_SPIN_S = 1e-3
# A message that arrives before its receive is posted waits this long, within this
# many bytes in all; a receive that gave up has its late message dropped for this long.
_EARLY_KEEP_S = 30.0
_EARLY_MAX_BYTES = 256 << 20
_FORGET_S = 60.0


@dataclass
class _Recv:
    buf: object
    nbytes: int
    fut: asyncio.Future


@dataclass
class _Send:
    req: object
    fut: asyncio.Future
    buf: object  # held until the send completes


@dataclass
class _Inflight:
    tag: int
    req: object  # the UCX request receiving the message
    recv: _Recv | None  # the receive it lands in; None: it lands in `sink`
    sink: np.ndarray | None = None


class UcxTransport:
    def __init__(self, net_devices: str = "", tls: str = "", progress_mode: str = "blocking"):
        self._net_devices = net_devices
        self._tls = tls
        self._progress_mode = progress_mode
        self._eps: dict[bytes, object] = {}
        self._ep_locks: dict[bytes, asyncio.Lock] = {}
        self.address = b""
        self._ucxx = None
        self._worker = None
        self._abandoned: dict[int, float] = {}  # tag -> monotonic time its receiver gave up
        self._janitor: asyncio.Task | None = None
        self._pending: dict[int, _Recv] = {}  # posted, nothing arrived yet
        self._inflight: list[_Inflight] = []  # arrived, bytes landing
        self._early: dict[int, tuple[np.ndarray, float]] = {}  # arrived before its receive
        self._early_bytes = 0
        self._prober: asyncio.Task | None = None
        self._spin_until = 0.0
        self._sending: list[_Send] = []

    async def start(self) -> None:
        os.environ.setdefault("UCXPY_LOG_LEVEL", "WARNING")
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 dropped
        import ucxx

        options = {}
        if self._net_devices:
            options["NET_DEVICES"] = self._net_devices  # bind to the configured interface only
        if self._tls:
            options["TLS"] = self._tls
        elif "UCX_TLS" not in os.environ:
            # Every transport but CMA. Measured between two processes on one host: CMA's
            # rendezvous reads ran 16-64 MiB messages at about half the copy bandwidth,
            # where the posix shared-memory path reached it; smaller sizes are unchanged.
            options["TLS"] = "^cma"
        try:
            ucxx.init(options=options, progress_mode=self._progress_mode)
        except RuntimeError:
            # Already initialised: a transport closed and made again in this process (tests
            # do). Never two at once: each one's loop takes every tagged message.
            log.debug("ucxx already initialised; reusing its context")
        self._ucxx = ucxx
        # The Python UCXWorker (tag_probe, recv_with_handle) hangs off the application context.
        self._worker = ucxx.core._get_ctx().worker
        self.address = bytes(ucxx.get_worker_address())
        ucxx.continuous_ucx_progress()
        self._janitor = asyncio.create_task(self._janitor_loop(), name="ucx-janitor")

    async def close(self) -> None:
        for task in (self._janitor, self._prober):
            if task is not None:
                task.cancel()
        self._janitor = self._prober = None
        eps, self._eps = self._eps, {}
        for ep in eps.values():
            try:
                ep.abort()
            except Exception:  # a peer that died leaves an endpoint that cannot close cleanly
                pass

    async def _endpoint(self, peer: bytes):
        ep = self._eps.get(peer)
        if ep is not None:
            return ep
        lock = self._ep_locks.setdefault(peer, asyncio.Lock())
        async with lock:
            ep = self._eps.get(peer)
            if ep is None:
                addr = self._ucxx.get_ucx_address_from_buffer(peer)
                ep = await self._ucxx.create_endpoint_from_worker_address(addr, endpoint_error_handling=False)
                self._eps[peer] = ep
        return ep

    def forget(self, peer: bytes) -> None:
        """Drop a cached endpoint (the peer restarted or died)."""
        ep = self._eps.pop(peer, None)
        if ep is not None:
            try:
                ep.abort()
            except Exception:
                pass

    # ---- receiving ------------------------------------------------------------------
    def post_recv(self, buf, tag: int) -> Transfer:
        nbytes = _nbytes(buf)
        fut = asyncio.get_running_loop().create_future()
        self._abandoned.pop(tag, None)
        early = self._early.pop(tag, None)
        if early is not None:
            data = early[0]
            self._early_bytes -= data.nbytes
            if data.nbytes != nbytes:
                fut.set_exception(TransferError(f"expected {nbytes} bytes under tag {tag:#x}, {data.nbytes} arrived"))
            else:
                _copy_into(buf, data)
                fut.set_result(None)
            return Transfer(fut, nbytes, lambda: True)
        r = _Recv(buf, nbytes, fut)
        self._pending[tag] = r
        self._kick()

        def try_cancel() -> bool:
            if self._pending.get(tag) is not r:  # its bytes are landing or have landed
                return fut.done()
            del self._pending[tag]
            fut.cancel()
            self._abandoned[tag] = time.monotonic()
            return True

        return Transfer(fut, nbytes, try_cancel)

    def _kick(self) -> None:
        self._spin_until = time.monotonic() + _SPIN_S
        if self._prober is None or self._prober.done():
            self._prober = asyncio.create_task(self._progress_loop(), name="ucx-progress")

    def _busy(self) -> bool:
        return bool(self._sending or self._pending or self._inflight)

    async def _progress_loop(self) -> None:
        """Progresses the worker while sends are in flight (their completion is seen only
        when the worker is progressed), takes arrivals and completes receives. Requests
        are checked here rather than awaited one task each: a task per message costs
        more than moving 1 MiB over shared memory. The delay grows while nothing
        happens, to bound the CPU this costs the event loop (and the engine thread,
        through the GIL)."""
        delay = _MIN_POLL_S
        while True:
            try:
                self._worker.progress()
                hit = self._take_arrivals()
                if hit:  # start the receives now (a rendezvous read), not a loop round later
                    self._worker.progress()
                hit = self._complete_finished() or hit
            except Exception as e:  # fail every waiting receive at once rather than let each time out
                log.exception("UCX progress failed")
                self._fail_all(TransferError(f"UCX progress failed: {type(e).__name__}: {e}"))
                return
            if not self._busy():
                return
            now = time.monotonic()
            if hit:
                self._spin_until = now + _SPIN_S
            if now < self._spin_until:
                delay = _MIN_POLL_S
                await asyncio.sleep(0)
            else:
                delay = min(delay * 2, _MAX_POLL_S)
                await asyncio.sleep(delay)

    def _fail_all(self, err: TransferError) -> None:
        waiting = [r.fut for r in self._pending.values()] + [i.recv.fut for i in self._inflight if i.recv is not None]
        waiting += [s.fut for s in self._sending]
        self._pending.clear()
        self._inflight.clear()
        self._sending.clear()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(err)

    def _take_arrivals(self) -> bool:
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMask

        took = False
        while True:
            probe = self._worker.tag_probe(Tag(0), TagMask(0), remove=True)  # any tag
            if not probe.matched:
                return took
            took = True
            tag = probe.sender_tag.value
            r = self._pending.pop(tag, None)
            if r is not None and probe.length == r.nbytes:
                item = _Inflight(tag, None, r)
                item.req = self._worker.tag_recv_with_handle(Array(r.buf), probe)
            else:
                # No receive for it (yet, or any more), or one of another size: take the
                # bytes anyway, so the sender completes and UCX frees what it buffered.
                item = _Inflight(tag, None, r, np.empty(probe.length, np.uint8))
                item.req = self._worker.tag_recv_with_handle(Array(item.sink), probe)
            self._inflight.append(item)

    def _complete_finished(self) -> bool:
        return self._complete_sends() | self._complete_receives()

    def _complete_sends(self) -> bool:
        done = [s for s in self._sending if s.req.completed]
        if not done:
            return False
        self._sending = [s for s in self._sending if not s.req.completed]
        for s in done:
            if s.fut.done():  # its sender timed out
                continue
            try:
                s.req.check_error()
            except Exception as e:
                s.fut.set_exception(e)
            else:
                s.fut.set_result(None)
        return True

    def _complete_receives(self) -> bool:
        done, still = [], []
        for i in self._inflight:
            (done if i.req.completed else still).append(i)
        if not done:
            return False
        self._inflight = still
        for item in done:
            try:
                item.req.check_error()
                err = None
            except Exception as e:
                err = TransferError(f"UCX receive under tag {item.tag:#x} failed: {e}")
            r = item.recv
            if r is None and err is None and item.tag in self._pending:
                # Its receive was posted while the bytes were landing in a sink of their own.
                r = self._pending.pop(item.tag)
                if item.sink.nbytes == r.nbytes:
                    _copy_into(r.buf, item.sink)
                    item.sink = None
            if r is not None:
                if err is None and item.sink is not None:
                    err = TransferError(f"expected {r.nbytes} bytes under tag {item.tag:#x}, "
                                        f"{item.sink.nbytes} arrived")
                if r.fut.done():
                    pass
                elif err is not None:
                    r.fut.set_exception(err)
                else:
                    r.fut.set_result(None)
            elif err is not None:
                log.warning("%s", err)
            elif self._abandoned.pop(item.tag, None) is not None:
                log.info("discarding %d bytes that arrived after their receive timed out", item.sink.nbytes)
            elif self._early_bytes + item.sink.nbytes > _EARLY_MAX_BYTES:
                log.warning("dropping %d bytes under tag %#x: no receive posted for them and %d bytes "
                            "already wait for theirs", item.sink.nbytes, item.tag, self._early_bytes)
            else:
                self._early[item.tag] = (item.sink, time.monotonic())
                self._early_bytes += item.sink.nbytes
        return True

    async def _janitor_loop(self) -> None:
        """Takes messages whose receiver gave up even when nothing else runs the progress
        loop, and forgets abandoned tags and unclaimed early arrivals after a while."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for tag, since in list(self._abandoned.items()):
                if now - since > _FORGET_S:
                    del self._abandoned[tag]
            for tag, (data, since) in list(self._early.items()):
                if now - since > _EARLY_KEEP_S:
                    log.warning("dropping %d bytes under tag %#x: no receive was posted for them", data.nbytes, tag)
                    del self._early[tag]
                    self._early_bytes -= data.nbytes
            if self._abandoned:
                self._kick()

    # ---- sending --------------------------------------------------------------------
    async def send(self, peer: bytes, buf, tag: int, timeout: float) -> None:
        from ucxx._lib.arr import Array
        from ucxx.types import Tag

        try:
            # asyncio.timeout, not wait_for: wait_for wraps the send in a task of its own,
            # which costs more than a 1 MiB transfer on shared memory.
            async with asyncio.timeout(timeout):
                ep = self._eps.get(peer) or await self._endpoint(peer)
                # The request is checked by the progress loop, like receives: awaiting
                # ucxx's own future adds a notifier round trip to every message.
                item = _Send(ep._ep.tag_send(Array(buf), Tag(tag)), asyncio.get_running_loop().create_future(), buf)
                self._sending.append(item)
                self._kick()
                await item.fut
        except TimeoutError:
            self.forget(peer)
            raise TransferError(f"UCX send of {_nbytes(buf)} bytes timed out after {timeout:.1f}s") from None
        except Exception as e:
            self.forget(peer)
            raise TransferError(f"UCX send failed: {type(e).__name__}: {e}") from None
        finally:
            self._spin_until = time.monotonic() + _SPIN_S  # the next send usually follows at once


def _copy_into(buf, data: np.ndarray) -> None:
    if hasattr(buf, "copy_"):  # a torch tensor, possibly on the GPU
        import torch

        buf.view(-1).view(torch.uint8).copy_(torch.from_numpy(data))
    else:
        memoryview(buf).cast("B")[:] = memoryview(data)


def _nbytes(buf) -> int:
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else len(memoryview(buf).cast("B"))
