"""One receive of KV bytes into staging memory, from reservation to release.

States (TransferState, polled through `state`, never by blocking):
1. BOOTSTRAPPING: staging memory reserved, the receive not posted yet;
2. WAITING_FOR_INPUT: the receive is posted under `tag`, and the sender can be asked;
3. TRANSFERRING: bytes are landing in the staging range;
4. SUCCESS: the bytes are in `slot`, until the caller releases it; or
   FAILED (`error` says why): staging full, the ask refused, a timeout, a broken
   transfer, or cancellation.

A failure abandons the receive first and frees the staging range only once nothing can
land in it any more; if bytes are landing right then, the range is freed when they have
landed. That clean-up lives here and nowhere else.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Awaitable, Callable, TypeVar

from moemesh.shared.transport.base import KVTransport, Transfer, TransferError, TransferState
from moemesh.shared.transport.staging import StagingPool, StagingSlot

log = logging.getLogger(__name__)
T = TypeVar("T")


class StagedReceive:
    def __init__(self, transport: KVTransport, staging: StagingPool, nbytes: int, what: str = "KV"):
        """Reserves nbytes of staging; if it is full the receive starts FAILED."""
        self._transport, self._staging = transport, staging
        self.nbytes = nbytes
        self.tag = random.getrandbits(62)
        self.transfer: Transfer | None = None
        self.error = ""
        self.slot: StagingSlot | None = staging.alloc(nbytes)
        if self.slot is None:
            self.error = f"{what} staging memory full ({nbytes} bytes needed)"

    @property
    def state(self) -> TransferState:
        if self.error:
            return TransferState.FAILED
        if self.transfer is None:
            return TransferState.BOOTSTRAPPING
        return self.transfer.state

    def post(self) -> None:
        """Post the receive: from here the sender may send under `tag`."""
        if self.slot is not None and self.transfer is None:
            self.transfer = self._transport.post_recv(self.slot.buffer(), self.tag)

    async def wait(self, timeout: float) -> None:
        """Wait for the bytes. Raises TransferError, the receive already abandoned."""
        if self.error:
            raise TransferError(self.error)
        self.post()
        try:
            await self.transfer.wait(timeout)
        except BaseException as e:
            self.fail(str(e) or type(e).__name__)
            raise

    async def run(self, ask: Callable[[int], Awaitable[T]], timeout: float) -> T:
        """Post the receive, ask the sender for the bytes (ask(tag), which raises to
        refuse), then wait for them: the ask and the bytes within `timeout` together, so a
        slow answer leaves the bytes less time rather than doubling the wait. Returns
        ask's answer. On any failure the receive is abandoned, and the exception goes on."""
        if self.error:
            raise TransferError(self.error)
        end = time.monotonic() + timeout
        self.post()
        try:
            answer = await ask(self.tag)
        except BaseException as e:
            self.fail(str(e) or type(e).__name__)
            raise
        await self.wait(max(0.01, end - time.monotonic()))
        return answer

    def fail(self, error: str) -> None:
        """Give up: abandon the receive and free the staging range once certainly free."""
        if not self.error:
            self.error = error
        slot, self.slot = self.slot, None
        if slot is None:
            return
        if self.transfer is None or self.transfer.cancel():
            self._staging.free(slot)
        else:  # bytes are landing: the range is free only once they have landed
            log.warning("a receive into %d staging bytes is still running; freeing them when it ends", slot.nbytes)
            self.transfer.add_done_callback(lambda _t: self._staging.free(slot))

    def release(self) -> None:
        """The bytes are used up (or not wanted): free the staging range. Safe to call
        twice, and after a failure."""
        if self.state != TransferState.SUCCESS:
            self.fail(self.error or "released before its bytes arrived")
            return
        slot, self.slot = self.slot, None
        if slot is not None:
            self._staging.free(slot)

