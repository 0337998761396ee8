"""Sending the KV of one hand-off: the second leg, after the decode worker's KVReady reply
has posted a receive for it.

States of a send: BOOTSTRAPPING (KVReady out; the leases are held for it and no abort
frees them) -> TRANSFERRING (their blocks gathered end to end into staging memory, then
one UCX send to the reply's address and tag) -> SUCCESS | FAILED. A send that fails, or
never starts (staging full, an address no live decode worker has), is told to the
receiver by tag (KVSendFailed), so it fails at once rather than at its timeout.
"""

from __future__ import annotations

import asyncio
import logging

from moemesh.services.prefill.leases import Lease
from moemesh.shared.engine import fork_io
from moemesh.shared.kv.events import KVPeers, first_beat_wait_s
from moemesh.shared.kv.spec import KVSpec
from moemesh.shared.transport.base import KVTransport, TransferError
from moemesh.shared.transport.staging import StagingPool

log = logging.getLogger(__name__)
INLINE_EXPORT_BYTES = 1 << 20  # larger exports are copied on a thread, off the event loop


class KVSender:
    def __init__(self, engine, spec: KVSpec, staging: StagingPool, transport: KVTransport, peers: KVPeers,
                 timeout_s: float, heartbeat_interval_s: float, fault: str = ""):
        """peers: the live decode workers, whose addresses alone get bytes. fault: the
        prefill config's debug_kv_fault ("drop": send nothing, say nothing; "error": fail)."""
        self._engine, self._spec, self._staging, self._transport = engine, spec, staging, transport
        self._peers, self._timeout_s, self._fault = peers, timeout_s, fault
        self._known_wait_s = first_beat_wait_s(heartbeat_interval_s)

    async def send(self, address: bytes, tag: int, leases: list[Lease]) -> int:
        """Gather the leases' blocks end to end, in order, and send them as one message.
        Returns the bytes sent. Raises TransferError (the message says why) when it
        cannot."""
        if not await self._peers.known_within(address, self._known_wait_s):
            raise TransferError("the receiving address belongs to no live decode worker")
        if self._fault == "error":
            raise TransferError("injected fault")
        total = sum(lease.nbytes for lease in leases)
        slot = self._staging.alloc(total)
        if slot is None:
            raise TransferError(f"prefill staging memory is full ({total} bytes needed)")
        try:
            off = 0
            for lease in leases:
                shape = self._spec.shape(lease.num_blocks, 1 + len(lease.forks))  # V4: a ring window per child
                dst = slot.part(off, lease.nbytes).typed(self._spec.dtype, shape)
                # A held request's blocks are never written by a step, so the copy runs beside
                # the engine, not between its steps: a send never waits behind a long prefill.
                # A small one is cheaper here than a thread's round trip.
                if lease.nbytes <= INLINE_EXPORT_BYTES:
                    _export(self._engine, lease, dst)
                else:
                    await asyncio.to_thread(_export, self._engine, lease, dst)
                off += lease.nbytes
            if self._fault != "drop":
                await self._transport.send(address, slot.buffer(), tag, self._timeout_s)
            return total
        except KeyError as e:  # a lease's blocks are gone: a bug, reported as a failed send
            raise TransferError(f"KV export failed: {e}") from None
        finally:
            self._staging.free(slot)


def _export(engine, lease: Lease, dst) -> None:
    if lease.forks:
        fork_io.export(engine, lease.request_ids, dst)
    else:
        engine.export_kv(lease.job.request_id, dst)
