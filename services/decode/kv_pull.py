"""Pulling the KV of one hand-off (one prefill step's requests for this worker) into
staging memory, as one message.

States of a pull: announced -> pulling -> arrived | failed, for the whole message; a
request the prefill worker no longer holds is failed on its own (its range holds
nothing). The receive is set up before the pull request goes out, so the sender never
waits for the receiver. On failure the receive is abandoned first (the transport
guarantees no late bytes land afterwards) and only then is the staging range freed.

The staging range is shared by the requests' imports, which happen one by one as cache
blocks free up: it is freed when the last of them is done (imported, failed or aborted).
"""

from __future__ import annotations

import enum
import logging
import random
from dataclasses import dataclass, field

from moemesh.shared.protocol.messages import KVPull, KVPullItem, KVPullReply, KVReady, KVReadyItem
from moemesh.shared.service.nats_io import RemoteError, Unreachable, request
from moemesh.shared.service.runtime import WorkerRuntime
from moemesh.shared.transport.base import TransferError
from moemesh.shared.transport.staging import StagingSlot

log = logging.getLogger(__name__)


class PullState(enum.Enum):
    ANNOUNCED = "announced"
    PULLING = "pulling"
    ARRIVED = "arrived"
    FAILED = "failed"


@dataclass
class Pull:
    """One request of a hand-off."""
    item: KVReadyItem
    batch: "PullBatch"
    offset: int  # of its bytes in the batch's staging range
    state: PullState = PullState.ANNOUNCED
    error: str = ""
    aborted: bool = False
    done: bool = False  # imported, failed or dropped: it no longer needs the staging range

    @property
    def request_id(self) -> str:
        return self.item.request_id

    def staging(self) -> StagingSlot:
        return self.batch.slot.part(self.offset, self.item.nbytes)


@dataclass
class PullBatch:
    ready: KVReady
    pulls: list[Pull] = field(default_factory=list)
    slot: StagingSlot | None = None
    state: PullState = PullState.ANNOUNCED
    error: str = ""

    @property
    def nbytes(self) -> int:
        return sum(p.item.nbytes for p in self.pulls)


def finish(rt: WorkerRuntime, pull: Pull) -> None:
    """This request no longer needs its bytes; the last one out frees the staging range."""
    pull.done = True
    b = pull.batch
    if b.slot is not None and all(p.done for p in b.pulls):
        rt.staging.free(b.slot)
        b.slot = None


async def pull_kv(rt: WorkerRuntime, batch: PullBatch, timeout_s: float, traceparents: list[str]) -> None:
    """Fills batch.slot with the requests' KV bytes, or sets states FAILED with reasons."""
    r = batch.ready
    slot = rt.staging.alloc(batch.nbytes)
    if slot is None:
        _fail_all(batch, f"decode staging memory full ({batch.nbytes} bytes needed)")
        return
    batch.slot = slot
    batch.state = PullState.PULLING
    for p in batch.pulls:
        p.state = PullState.PULLING
    tag = random.getrandbits(63)
    transfer = rt.transport.post_recv(slot.buffer(), tag)
    try:
        msg = KVPull([KVPullItem(p.request_id, p.item.lease_id, p.item.nbytes, tp)
                      for p, tp in zip(batch.pulls, traceparents)], rt.transport.address, tag)
        reply = await request(rt.nc, rt.subjects.kv_pull(r.prefill_id), msg, KVPullReply, timeout_s)
        if not reply.ok:
            raise TransferError(f"prefill worker refused the pull: {reply.error}")
        await transfer.wait(timeout_s)
        batch.state = PullState.ARRIVED
        for p in batch.pulls:
            why = reply.failed.get(p.request_id)
            p.state, p.error = (PullState.FAILED, why) if why else (PullState.ARRIVED, "")
    except (TransferError, Unreachable, RemoteError) as e:
        _fail_all(batch, str(e))
        batch.slot = None
        if await transfer.abandon(timeout_s):
            rt.staging.free(slot)
        else:  # a receive still writing: free the range only once it is done
            log.warning("a receive into %d staging bytes is still running; freeing when it ends", slot.nbytes)
            transfer.add_done_callback(lambda _t, s=slot: rt.staging.free(s))


def _fail_all(batch: PullBatch, error: str) -> None:
    batch.state, batch.error = PullState.FAILED, error
    for p in batch.pulls:
        p.state, p.error = PullState.FAILED, error
