"""Pulling the KV of one hand-off (one prefill step's requests for this worker) into
staging memory, as one message.

States of a pull (TransferState, polled): BOOTSTRAPPING (announced, staging reserved)
-> WAITING_FOR_INPUT (receive posted, KVPull sent) -> TRANSFERRING -> SUCCESS | FAILED,
for the whole message; a request the prefill worker no longer holds is failed on its
own (its range holds nothing). The receive is set up before the pull request goes out,
so the sender never waits for the receiver; its clean-up on failure is the staged
receive's (shared/kv/receive.py).

The staging range is shared by the requests' imports, which happen one by one as cache
blocks free up: it is freed when the last of them is done (imported, failed or aborted).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from moemesh.shared.kv.receive import StagedReceive
from moemesh.shared.protocol.messages import KVPull, KVPullItem, KVPullReply, KVReady, KVReadyItem
from moemesh.shared.service.nats_io import RemoteError, Unreachable, request
from moemesh.shared.service.runtime import WorkerRuntime
from moemesh.shared.transport.base import TransferError, TransferState
from moemesh.shared.transport.staging import StagingSlot

log = logging.getLogger(__name__)


@dataclass
class Pull:
    """One request of a hand-off, with the children of its prompt whose KV moves with it
    (KVReadyItem.forks): one range of bytes, one lease."""
    item: KVReadyItem
    batch: "PullBatch"
    offset: int  # of its bytes in the batch's staging range
    reason: str = ""  # why this request alone failed (the prefill worker no longer held it)
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
        return TransferState.FAILED if self.reason else self.batch.state

    @property
    def error(self) -> str:
        return self.reason or self.batch.error

    def staging(self) -> StagingSlot:
        return self.batch.rx.slot.part(self.offset, self.item.nbytes)


@dataclass
class PullBatch:
    ready: KVReady
    pulls: list[Pull] = field(default_factory=list)
    rx: StagedReceive | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.item.nbytes for p in self.pulls)

    @property
    def state(self) -> TransferState:
        return TransferState.BOOTSTRAPPING if self.rx is None else self.rx.state

    @property
    def error(self) -> str:
        return self.rx.error if self.rx is not None else ""


def finish(rt: WorkerRuntime, pull: Pull) -> None:
    """This request no longer needs its bytes; the last one out frees the staging range."""
    pull.done = True
    b = pull.batch
    if b.rx is not None and all(p.done for p in b.pulls):
        b.rx.release()


async def pull_kv(rt: WorkerRuntime, batch: PullBatch, timeout_s: float, traceparents: list[str]) -> None:
    """Fills the batch's staging range with the requests' KV bytes, or leaves it FAILED
    (with reasons, and its staging already given back)."""
    r = batch.ready
    rx = batch.rx = StagedReceive(rt.transport, rt.staging, batch.nbytes, "decode")

    async def ask(tag: int) -> KVPullReply:
        msg = KVPull([KVPullItem(p.request_id, p.item.lease_id, p.item.nbytes, tp)
                      for p, tp in zip(batch.pulls, traceparents)], rt.transport.address, tag)
        reply = await request(rt.nc, rt.subjects.kv_pull(r.prefill_id), msg, KVPullReply, timeout_s)
        if not reply.ok:
            raise TransferError(f"prefill worker refused the pull: {reply.error}")
        return reply

    try:
        reply = await rx.run(ask, timeout_s)
    except (TransferError, Unreachable, RemoteError):
        return  # rx.error says why
    for p in batch.pulls:
        p.reason = reply.failed.get(p.request_id, "")
