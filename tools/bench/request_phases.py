"""Where requests' time went on the mesh's workers, with tracing off: each worker's phase
rows (shared/service/runtime.py, WorkerStats.recent_requests) fetched over NATS, and
percentiles over a load window. `bench stream` and `bench serve --nats-url` report them.

Phases: prefill workers: queue (job in -> first scheduled), prefill (-> first token);
decode workers: dispatch (the prefill worker's first token -> its KVReady here), transfer
(-> the bytes in staging), import (-> into the cache and a step that ran), first_step
(that step). hand-off = dispatch + transfer + import: what the second token waits for
beyond one decode step. Rows are stamped on the wall clock when their last phase ended;
workers on other hosts are assumed in sync.
"""

from __future__ import annotations

import asyncio

from moemesh.tools.bench.env import percentile

ROLES = ("prefill", "decode")


def _role(worker_id: str) -> str:
    return worker_id.split("-", 1)[0]


async def fetch(nats_url: str, workers: list[str], prefix: str = "mm", timeout_s: float = 10.0) -> dict:
    """Worker id -> (its phase names, its recent rows), for those of `workers` that answer."""
    import nats

    from moemesh.shared.protocol.messages import StatsRequest, WorkerStats
    from moemesh.shared.protocol.subjects import Subjects
    from moemesh.shared.service.nats_io import request

    nc = await nats.connect(nats_url)
    try:
        out = {}
        for w in workers:
            try:
                st = await request(nc, Subjects(prefix).stats(w), StatsRequest(detail=True), WorkerStats, timeout_s)
            except Exception:  # gone since it was seen: its rows are lost with it
                continue
            out[w] = (st.request_phases, st.recent_requests)
        return out
    finally:
        await nc.close()


async def live_workers(nats_url: str, prefix: str = "mm", seconds: float = 2.5) -> list[str]:
    """The prefill and decode workers whose heartbeats come within `seconds` (a few beats)."""
    import nats

    from moemesh.shared.protocol.messages import Heartbeat, ProtocolError, decode
    from moemesh.shared.protocol.subjects import Subjects

    nc = await nats.connect(nats_url)
    seen: dict[str, str] = {}

    async def on_beat(msg) -> None:
        try:
            hb = decode(msg.data, Heartbeat)
        except ProtocolError:
            return
        if hb.role in ROLES:
            seen[hb.worker_id] = hb.role

    try:
        sub = await nc.subscribe(Subjects(prefix).heartbeat_all, cb=on_beat)
        await asyncio.sleep(seconds)
        await sub.unsubscribe()
        return sorted(seen)
    finally:
        await nc.close()


def figures(by_worker: dict[str, tuple[list, list]], t0: float, t1: float, step_ms: float | None = None) -> dict:
    """p50/p90/p99 in ms of every phase over the rows that ended in [t0, t1] (wall clock),
    the workers of one role pooled; for decode workers also the hand-off, and with
    step_ms (a mock's fixed step) the hand-off in steps."""
    pooled: dict[str, tuple[list, list[list[float]]]] = {}  # role -> (phase names, rows)
    for name, (phases, rows) in by_worker.items():
        pooled.setdefault(_role(name), (phases, []))[1].extend(r for r in rows if t0 <= r[0] <= t1)
    out = {}
    for role, (names, rows) in pooled.items():
        if not rows:
            continue
        cols = {n: [r[1 + i] for r in rows] for i, n in enumerate(names)}
        if {"dispatch", "transfer", "import"} <= set(cols):
            cols["handoff"] = [a + b + c for a, b, c in zip(cols["dispatch"], cols["transfer"], cols["import"])]
        fig = {n: {f"p{q}": percentile(v, q) * 1e3 for q in (50, 90, 99)} for n, v in cols.items()}
        if "handoff" in fig and step_ms:
            fig["handoff_steps"] = {k: v / step_ms for k, v in fig["handoff"].items()}
        out[role] = {"requests": len(rows), **fig}
    return out


def p50_p90(x: dict | None) -> str:
    """One phase's figures as "p50/p90" ("-" when it has none)."""
    return "-" if not x else f"{x['p50']:.1f}/{x['p90']:.1f}"


def line(fig: dict) -> str:
    """One point's figures as text: p50/p90 ms of each phase."""
    q = p50_p90
    pre, dec = fig.get("prefill", {}), fig.get("decode", {})
    parts = [f"queue {q(pre.get('queue'))}", f"prefill {q(pre.get('prefill'))}",
             f"dispatch {q(dec.get('dispatch'))}", f"transfer {q(dec.get('transfer'))}",
             f"import {q(dec.get('import'))}", f"hand-off {q(dec.get('handoff'))}",
             f"first decode step {q(dec.get('first_step'))}"]
    return ", ".join(parts) + " (p50/p90 ms)"
