"""Receiving the KV of one hand-off (one prefill step's requests for this worker) into
staging memory, as one message, in two legs: KVReady's reply carries the receive, then
the bytes come.

States of a hand-off's receive (TransferState, polled): BOOTSTRAPPING (staging reserved)
-> WAITING_FOR_INPUT (receive posted under a fresh tag; the KVReady reply names it, with
this worker's UCX address and the requests whose bytes it expects, in order) ->
TRANSFERRING -> SUCCESS | FAILED, for the whole message. The receive is posted before
the reply goes, so the sender never waits for the receiver. A sender that cannot send
says so (KVSendFailed, by tag) and the receive fails at once; a sender that says nothing
leaves it to the transfer timeout. Clean-up on failure is the staged receive's
(StagedReceive, shared/transport/staging.py).

The staging range is shared by the requests' imports, which happen one by one as cache
blocks free up: it is freed when the last of them is done (imported, failed or aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from moemesh.shared.protocol.messages import KVReady, KVReadyItem
from moemesh.shared.transport.base import KVTransport, TransferError, TransferState
from moemesh.shared.transport.staging import StagedReceive, StagingPool, StagingSlot

log = logging.getLogger(__name__)


@dataclass
class Pull:
    """One request of a hand-off, with the children of its prompt whose KV moves with it
    (KVReadyItem.forks): one range of bytes, one lease."""
    item: KVReadyItem
    batch: "PullBatch"
    offset: int  # of its bytes in the batch's staging range
    skip: set[str] = field(default_factory=set)  # requests in it refused or aborted: not to run
    done: bool = False  # imported, failed or dropped: it no longer needs the staging range

    @property
    def request_id(self) -> str:
        """The request that names its lease."""
        return self.item.request_id

    @property
    def request_ids(self) -> list[str]:
        return [self.item.request_id, *(f.request_id for f in self.item.forks)]

    @property
    def aborted(self) -> bool:
        return all(r in self.skip for r in self.request_ids)

    def abort(self, request_id: str) -> None:
        self.skip.add(request_id)

    @property
    def state(self) -> TransferState:
        return self.batch.state

    @property
    def error(self) -> str:
        return self.batch.error

    def staging(self) -> StagingSlot:
        return self.batch.rx.slot.part(self.offset, self.item.nbytes)


@dataclass
class PullBatch:
    ready: KVReady
    pulls: list[Pull] = field(default_factory=list)
    rx: StagedReceive | None = None
    sender_failed: asyncio.Future | None = None  # the sender's reason, if it says it cannot send

    @property
    def nbytes(self) -> int:
        return sum(p.item.nbytes for p in self.pulls)

    @property
    def state(self) -> TransferState:
        return TransferState.BOOTSTRAPPING if self.rx is None else self.rx.state

    @property
    def error(self) -> str:
        return self.rx.error if self.rx is not None else ""


class KVReceiver:
    """The decode side of hand-offs: posts a batch's receive, waits for its bytes (or the
    sender's word that they will not come), and frees staging after the last import."""

    def __init__(self, transport: KVTransport, staging: StagingPool, timeout_s: float):
        self._transport, self._staging, self._timeout_s = transport, staging, timeout_s
        self._waiting: dict[int, PullBatch] = {}  # tag -> a batch whose bytes are on their way

    @property
    def address(self) -> bytes:
        return self._transport.address

    @property
    def in_flight(self) -> int:
        """Hand-offs whose bytes are on their way."""
        return len(self._waiting)

    def post(self, batch: PullBatch) -> int:
        """Reserve the batch's staging and post its receive. Returns its tag, or 0 when
        it cannot be received (staging full: the batch is FAILED, and nothing is to be sent)."""
        rx = batch.rx = StagedReceive(self._transport, self._staging, batch.nbytes, "decode")
        if rx.state is TransferState.FAILED:
            return 0
        rx.post()
        batch.sender_failed = asyncio.get_running_loop().create_future()
        self._waiting[rx.tag] = batch
        return rx.tag

    def sender_failed(self, tag: int, error: str) -> None:
        """The sender of `tag` will not send (an unknown tag is ignored: already over)."""
        b = self._waiting.get(tag)
        if b is not None and not b.sender_failed.done():
            b.sender_failed.set_result(error)

    async def wait(self, batch: PullBatch) -> None:
        """Until the batch's bytes are in staging, or it is FAILED (rx.error says why)."""
        rx = batch.rx
        if rx is None or rx.state is TransferState.FAILED:
            return
        landed = asyncio.ensure_future(rx.wait(self._timeout_s))
        try:
            await asyncio.wait({landed, batch.sender_failed}, return_when=asyncio.FIRST_COMPLETED)
            if not landed.done():
                rx.fail(f"the prefill worker did not send: {batch.sender_failed.result()}")
                landed.cancel()
            with contextlib.suppress(TransferError, asyncio.CancelledError):
                await landed
        finally:
            self._waiting.pop(rx.tag, None)
            if not landed.done():
                landed.cancel()

    @staticmethod
    def finish(pull: Pull) -> None:
        """This request no longer needs its bytes; the last one out frees the staging range."""
        pull.done = True
        b = pull.batch
        if b.rx is not None and all(p.done for p in b.pulls):
            b.rx.release()
