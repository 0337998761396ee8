"""KV held for a decode worker: one lease per request, with an expiry."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from moemesh.shared.protocol.messages import PrefillJob

_ids = itertools.count(1)


@dataclass
class Lease:
    job: PrefillJob
    num_blocks: int
    nbytes: int
    expires_at: float
    lease_id: int = field(default_factory=lambda: next(_ids))
    pulling: bool = False


class LeaseTable:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.by_request: dict[str, Lease] = {}

    def grant(self, job: PrefillJob, num_blocks: int, nbytes: int, now: float | None = None) -> Lease:
        now = time.monotonic() if now is None else now
        lease = Lease(job, num_blocks, nbytes, now + self.timeout_s)
        self.by_request[job.request_id] = lease
        return lease

    def get(self, request_id: str, lease_id: int) -> Lease | None:
        lease = self.by_request.get(request_id)
        return lease if lease is not None and lease.lease_id == lease_id else None

    def pop(self, request_id: str) -> Lease | None:
        return self.by_request.pop(request_id, None)

    def expired(self, now: float | None = None) -> list[Lease]:
        now = time.monotonic() if now is None else now
        return [l for l in self.by_request.values() if l.expires_at <= now and not l.pulling]

    def __len__(self) -> int:
        return len(self.by_request)
