"""The data-plane seam: moving raw bytes between workers.

A transport sends a buffer to a peer, identified by its worker address, under a
64-bit tag, and receives into a buffer that was allocated ahead of time. Every
receive is a Transfer whose state can be polled; nothing blocks without a timeout.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Callable, Protocol


class TransferState(enum.Enum):
    """Where a receive stands, to poll without awaiting (SGLang's KVPoll, receiver side).

    BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS, or FAILED from any.
    A bare Transfer starts at WAITING_FOR_INPUT; BOOTSTRAPPING is the staged receive's
    (StagedReceive, shared/transport/staging.py) time between reserving staging memory and posting."""

    BOOTSTRAPPING = "bootstrapping"  # staging reserved, receive not posted yet
    WAITING_FOR_INPUT = "waiting_for_input"  # receive posted, nothing arrived yet
    TRANSFERRING = "transferring"  # bytes are landing in the buffer
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (TransferState.SUCCESS, TransferState.FAILED)


class TransferError(RuntimeError):
    pass


class Transfer:
    """A posted receive. `state` can be polled; `wait(timeout)` raises TransferError."""

    def __init__(self, task: asyncio.Future, nbytes: int, try_cancel: Callable[[], bool] | None = None,
                 landing: Callable[[], bool] | None = None):
        """try_cancel: stops the receive if no bytes can land in the buffer any more
        and returns True; returns False when a receive is already under way.
        landing: whether bytes are landing right now (TRANSFERRING); a transport that
        copies in one go (loopback) has no such moment and passes None."""
        self._task = task
        self.nbytes = nbytes
        self.error: str | None = None
        self._try_cancel = try_cancel
        self._landing = landing

    @property
    def state(self) -> TransferState:
        if not self._task.done():
            if self._landing is not None and self._landing():
                return TransferState.TRANSFERRING
            return TransferState.WAITING_FOR_INPUT
        if self._task.cancelled() or self._task.exception() is not None:
            return TransferState.FAILED
        return TransferState.SUCCESS

    def cancel(self) -> bool:
        """Stop the receive unless bytes are landing. Returns True when the buffer is
        certainly free (nothing can land in it any more, or the receive finished)."""
        if self._task.done():
            return True
        return self._try_cancel is not None and self._try_cancel()

    async def wait(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except asyncio.TimeoutError:
            if self._try_cancel is not None and not self._try_cancel():
                # The bytes are arriving: let them finish rather than abandon a live receive.
                return await self.wait(timeout)
            self.error = f"no data within {timeout:.1f}s"
            raise TransferError(self.error) from None
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            raise TransferError(self.error) from None

    async def abandon(self, timeout: float) -> bool:
        """Give up on this receive. Returns True when the buffer is certainly free
        again: either nothing can land in it any more, or the receive finished."""
        if self.cancel():
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except Exception:
            pass
        return self._task.done()

    def add_done_callback(self, fn) -> None:
        self._task.add_done_callback(lambda _t: fn(self))


class KVTransport(Protocol):
    address: bytes  # this worker's address, shared with peers over NATS

    async def start(self) -> None:
        """Bring the transport up. Args: none. Returns when `address` is valid."""

    async def close(self) -> None:
        """Tear down endpoints; safe to call twice."""

    def post_recv(self, buf, tag: int) -> Transfer:
        """Post a receive of exactly len(buf) bytes under `tag` into `buf`.

        Args: buf: host buffer or CUDA array allocated ahead of time; tag: 64-bit id.
        Returns: a Transfer to poll or wait on."""

    async def send(self, peer: bytes, buf, tag: int, timeout: float) -> None:
        """Send `buf` to the worker at address `peer` under `tag`.

        Raises TransferError on failure or when `timeout` seconds pass."""
