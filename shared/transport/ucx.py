"""UCX data plane (ucxx), set up for the fast path measured on this project:

- endpoints are made from UCX worker addresses that peers exchange over NATS, never
  through a listener;
- endpoint error handling is off, which keeps shared-memory transports eligible
  (with it on, UCX falls back to TCP: 20-40x slower);
- progress runs in "blocking" mode on the asyncio loop (an epoll fd), not a thread;
- receives land in staging memory allocated once (see staging.py).

ucxx keeps one context per process, so one UcxTransport per process.
"""

from __future__ import annotations

import asyncio
import logging
import os

from shared.transport.base import Transfer, TransferError

log = logging.getLogger(__name__)


class UcxTransport:
    def __init__(self, net_devices: str = "", tls: str = "", progress_mode: str = "blocking"):
        self._net_devices = net_devices
        self._tls = tls
        self._progress_mode = progress_mode
        self._eps: dict[bytes, object] = {}
        self._ep_locks: dict[bytes, asyncio.Lock] = {}
        self.address = b""
        self._ucxx = None

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
        self.address = bytes(ucxx.get_worker_address())
        ucxx.continuous_ucx_progress()

    async def close(self) -> None:
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

    def post_recv(self, buf, tag: int) -> Transfer:
        task = asyncio.ensure_future(self._ucxx.recv(buf, tag=tag))
        return Transfer(task, _nbytes(buf))

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
