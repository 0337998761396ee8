"""UCX data plane (ucxx), set up for the fast path measured on this project:

- endpoints are made from UCX worker addresses that peers exchange over NATS, never
  through a listener;
- endpoint error handling is off, which keeps shared-memory transports eligible
  (with it on, UCX falls back to TCP: 20-40x slower);
- progress runs in "blocking" mode on the asyncio loop (an epoll fd), not a thread;
- receives land in staging memory allocated once (see staging.py).

A receive is not posted up front. It probes for its tag and receives only once the
message has arrived (tag_probe + recv_with_handle), so a receive that times out leaves
nothing behind in UCX that could later write into memory already handed to someone
else. Messages that arrive after their receiver gave up are drained and discarded.

ucxx keeps one context per process, so one UcxTransport per process.
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


@dataclass
class _Recv:
    buf: object
    nbytes: int
    fut: asyncio.Future
    posted: bool = False


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
        self._pending: dict[int, _Recv] = {}
        self._prober: asyncio.Task | None = None

    async def start(self) -> None:
        os.environ.setdefault("UCXPY_LOG_LEVEL", "WARNING")
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 dropped
        import ucxx

        options = {}
        if self._net_devices:
            options["NET_DEVICES"] = self._net_devices  # bind to the configured interface only
        if self._tls:
            options["TLS"] = self._tls
        try:
            ucxx.init(options=options, progress_mode=self._progress_mode)
        except RuntimeError:
            # Already initialised in this process (tests run several services in one).
            log.debug("ucxx already initialised; reusing its context")
        self._ucxx = ucxx
        # The Python UCXWorker (tag_probe, recv_with_handle) hangs off the application context.
        self._worker = ucxx.core._get_ctx().worker
        self.address = bytes(ucxx.get_worker_address())
        ucxx.continuous_ucx_progress()
        self._janitor = asyncio.create_task(self._drain_abandoned(), name="ucx-janitor")

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
        self._pending[tag] = _Recv(buf, nbytes, fut)
        if self._prober is None or self._prober.done():
            self._prober = asyncio.create_task(self._probe_loop(), name="ucx-prober")

        def try_cancel() -> bool:
            r = self._pending.get(tag)
            if r is None or r.posted:
                return fut.done()
            del self._pending[tag]
            fut.cancel()
            self._abandoned[tag] = time.monotonic()
            return True

        return Transfer(fut, nbytes, try_cancel)

    async def _probe_loop(self) -> None:
        """One task probes for every pending tag; a receive is posted only for a message
        that has arrived. The delay grows while nothing arrives, to bound the CPU this
        costs the event loop (and the engine thread, through the GIL)."""
        from ucxx._lib.arr import Array
        from ucxx.types import Tag

        delay = _MIN_POLL_S
        while any(not r.posted for r in self._pending.values()):
            self._worker.progress()
            hit = False
            for tag, r in list(self._pending.items()):
                if r.posted:
                    continue
                probe = self._worker.tag_probe(Tag(tag), remove=True)
                if not probe.matched:
                    continue
                hit = True
                r.posted = True  # from here on bytes may land in the buffer
                asyncio.ensure_future(self._receive(tag, r, probe, Array))
            delay = _MIN_POLL_S if hit else min(delay * 2, _MAX_POLL_S)
            await asyncio.sleep(delay)

    async def _receive(self, tag: int, r: "_Recv", probe, Array) -> None:
        try:
            if probe.length != r.nbytes:
                sink = np.empty(probe.length, np.uint8)  # held by name: Array does not keep it alive
                await self._worker.tag_recv_with_handle(Array(sink), probe).wait()
                raise TransferError(f"expected {r.nbytes} bytes under tag {tag:#x}, {probe.length} arrived")
            await self._worker.tag_recv_with_handle(Array(r.buf), probe).wait()
        except Exception as e:
            if not r.fut.done():
                r.fut.set_exception(e if isinstance(e, TransferError) else TransferError(str(e)))
        else:
            if not r.fut.done():
                r.fut.set_result(None)
        finally:
            self._pending.pop(tag, None)

    async def _drain_abandoned(self) -> None:
        """Receive and drop messages whose receiver timed out, so their senders complete
        and UCX frees what it buffered. Tags are forgotten after a minute."""
        while True:
            await asyncio.sleep(0.5)
            try:
                await self._drain_once()
            except Exception:  # keep trying later; this must not stop the janitor
                log.exception("draining abandoned UCX messages failed")

    async def _drain_once(self) -> None:
        from ucxx._lib.arr import Array
        from ucxx.types import Tag

        if not self._abandoned:
            return
        now = time.monotonic()
        self._worker.progress()
        for tag, since in list(self._abandoned.items()):
            probe = self._worker.tag_probe(Tag(tag), remove=True)
            if probe.matched:
                log.info("discarding %d bytes that arrived after their receive timed out", probe.length)
                sink = np.empty(probe.length, np.uint8)  # held by name: Array does not keep it alive
                await self._worker.tag_recv_with_handle(Array(sink), probe).wait()
            if probe.matched or now - since > 60:
                self._abandoned.pop(tag, None)

    # ---- sending --------------------------------------------------------------------
    async def send(self, peer: bytes, buf, tag: int, timeout: float) -> None:
        try:
            ep = await asyncio.wait_for(self._endpoint(peer), timeout)
            await asyncio.wait_for(ep.send(buf, tag=tag, force_tag=True), timeout)
        except asyncio.TimeoutError:
            self.forget(peer)
            raise TransferError(f"UCX send of {_nbytes(buf)} bytes timed out after {timeout:.1f}s") from None
        except Exception as e:
            self.forget(peer)
            raise TransferError(f"UCX send failed: {type(e).__name__}: {e}") from None


def _nbytes(buf) -> int:
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else len(memoryview(buf).cast("B"))
