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
    # Parallel sampling: children of the job's prompt whose KV moves with it (one buffer),
    # and those of all of them not aborted yet; the lease goes when none is left.
    forks: list[str] = field(default_factory=list)
    live: set[str] = field(default_factory=set)

    @property
    def request_ids(self) -> list[str]:
        return [self.job.request_id, *self.forks]


class LeaseTable:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.by_request: dict[str, Lease] = {}  # by the request that names it
        self._fork_of: dict[str, str] = {}  # a fork's request id -> the one naming its lease

    def grant(self, job: PrefillJob, num_blocks: int, nbytes: int, now: float | None = None,
              forks: list[str] = ()) -> Lease:
        now = time.monotonic() if now is None else now
        lease = Lease(job, num_blocks, nbytes, now + self.timeout_s, forks=list(forks))
        lease.live = set(lease.request_ids)
        self.by_request[job.request_id] = lease
        for rid in forks:
            self._fork_of[rid] = job.request_id
        return lease

    def of(self, request_id: str) -> Lease | None:
        """The lease that holds a request's KV, whether it names it or is a fork in it."""
        return self.by_request.get(self._fork_of.get(request_id, request_id))

    def get(self, request_id: str, lease_id: int) -> Lease | None:
        lease = self.by_request.get(request_id)
        return lease if lease is not None and lease.lease_id == lease_id else None

    def pop(self, request_id: str) -> Lease | None:
        lease = self.by_request.pop(request_id, None)
        if lease is not None:
            for rid in lease.forks:
                self._fork_of.pop(rid, None)
        return lease

    def expired(self, now: float | None = None) -> list[Lease]:
        now = time.monotonic() if now is None else now
        return [l for l in self.by_request.values() if l.expires_at <= now and not l.pulling]

    def __len__(self) -> int:
        return len(self.by_request)
