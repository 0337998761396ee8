"""Aborts remembered for a while. An abort can overtake the work it cancels: the gateway
broadcasts it at once, while the job or the KV hand-off is still on its way. A worker that
forgot the abort would then run the request for nobody."""

from __future__ import annotations

import time
from collections import OrderedDict

ABORT_MEMORY_S = 60.0  # longer than any hand-off may take (lease and transfer timeouts)
MAX_REMEMBERED = 100_000  # a flood of aborts costs bounded memory; the oldest are forgotten first


class Tombstones:
    def __init__(self, ttl_s: float = ABORT_MEMORY_S, max_size: int = MAX_REMEMBERED):
        self._ttl, self._max = ttl_s, max_size
        self._until: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._until.pop(request_id, None)
        self._until[request_id] = now + self._ttl
        self._prune(now)

    def __contains__(self, request_id: str) -> bool:
        until = self._until.get(request_id)
        return until is not None and until > time.monotonic()

    def __len__(self) -> int:
        return len(self._until)

    def _prune(self, now: float) -> None:
        while self._until and (len(self._until) > self._max or next(iter(self._until.values())) <= now):
            self._until.popitem(last=False)
