"""Where each request's time went on one worker, with tracing off: a few clock readings a
request, kept as a row of phase durations for the last requests and as one Prometheus
histogram labelled by phase.

The rows answer StatsRequest(detail=True) (WorkerStats.recent_requests, columns named by
WorkerStats.request_phases): `moemesh bench stream` reads them over a point's load window
and takes exact percentiles, which a histogram's buckets cannot give at a few
milliseconds. The histogram is for an operator's dashboards, with buckets fine enough to
tell one 5 ms decode step from two.
"""

from __future__ import annotations

import time
from collections import deque

from moemesh.shared.telemetry.metrics import Metrics

# 0.5 ms apart to 10 ms, 2.5 ms apart to 30 ms, then as the default latency buckets.
PHASE_BUCKETS = (*(i * 0.0005 for i in range(1, 21)), 0.0125, 0.015, 0.0175, 0.02, 0.0225, 0.025, 0.0275, 0.03,
                 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MAX_ROWS = 4096


class PhaseLog:
    """One worker's per-request phases, in a fixed order."""

    def __init__(self, metrics: Metrics, name: str, doc: str, phases: tuple[str, ...], max_rows: int = MAX_ROWS):
        self.phases = phases
        self.rows: deque[list[float]] = deque(maxlen=max_rows)
        hist = metrics.histogram(name, doc, ("phase",), buckets=PHASE_BUCKETS)
        self._by_phase = [hist.labels(p) for p in phases]

    def record(self, *seconds: float) -> None:
        """One request's phases, in seconds, in the order of `phases`; the row is stamped
        with the wall clock now (when its last phase ended)."""
        if len(seconds) != len(self.phases):
            raise ValueError(f"{len(self.phases)} phases {self.phases}, got {len(seconds)} durations")
        self.rows.append([time.time(), *seconds])
        for h, s in zip(self._by_phase, seconds):
            h.observe(max(s, 0.0))

    def stats_fields(self, detail: bool) -> dict:
        """Its part of a WorkerStats reply: the rows only when asked for detail."""
        return {"request_phases": list(self.phases), "recent_requests": list(self.rows) if detail else []}
