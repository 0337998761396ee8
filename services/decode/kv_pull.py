"""Pulling one request's KV from its prefill worker into staging memory.

States: announced -> pulling -> arrived | failed. The receive is set up before the
pull request goes out, so the sender never waits for the receiver. On failure the
receive is abandoned first (the transport guarantees no late bytes land afterwards)
and only then is the staging range freed.
"""

from __future__ import annotations

import enum
import logging
import random
from dataclasses import dataclass

from shared.protocol.messages import KVPull, KVPullReply, KVReady
from shared.service.nats_io import RemoteError, Unreachable, request
from shared.service.runtime import WorkerRuntime
from shared.transport.base import TransferError
from shared.transport.staging import StagingSlot

log = logging.getLogger(__name__)


class PullState(enum.Enum):
    ANNOUNCED = "announced"
    PULLING = "pulling"
    ARRIVED = "arrived"
    FAILED = "failed"


@dataclass
class Pull:
    ready: KVReady
    state: PullState = PullState.ANNOUNCED
    slot: StagingSlot | None = None
    error: str = ""
    aborted: bool = False


async def pull_kv(rt: WorkerRuntime, pull: Pull, timeout_s: float, headers: dict | None) -> None:
    """Fills pull.slot with the request's KV bytes, or sets state FAILED with a reason."""
    r = pull.ready
    slot = rt.staging.alloc(r.nbytes)
    if slot is None:
        pull.state, pull.error = PullState.FAILED, f"decode staging memory full ({r.nbytes} bytes needed)"
        return
    pull.slot = slot
    pull.state = PullState.PULLING
    tag = random.getrandbits(63)
    transfer = rt.transport.post_recv(slot.buffer(), tag)
    try:
        msg = KVPull(r.request_id, r.lease_id, rt.transport.address, tag, r.nbytes)
        reply = await request(rt.nc, rt.subjects.kv_pull(r.prefill_id), msg, KVPullReply, timeout_s, headers)
        if not reply.ok:
            raise TransferError(f"prefill worker refused the pull: {reply.error}")
        await transfer.wait(timeout_s)
        pull.state = PullState.ARRIVED
    except (TransferError, Unreachable, RemoteError) as e:
        pull.state, pull.error = PullState.FAILED, str(e)
        pull.slot = None
        if await transfer.abandon(timeout_s):
            rt.staging.free(slot)
        else:  # a receive still writing: free the range only once it is done
            log.warning("a receive into %d staging bytes is still running; freeing when it ends", slot.nbytes)
            transfer.add_done_callback(lambda _t, s=slot: rt.staging.free(s))
