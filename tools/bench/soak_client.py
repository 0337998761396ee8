"""The soak's load client: `streams` lanes, each sending one streamed request after
another until the soak's end, every outcome kept. In its own process (tools/bench/rack.py
starts it), so that its CPU is not the gateway's.

    python -m moemesh.tools.bench.soak_client '<SoakLoad as JSON>'

Prints one JSON line at the end: every request's outcome in the words of
tools/bench/chaos_report.py (complete, short, wrong, error, hung), the errors by kind,
and the longest stall.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass

import httpx

from moemesh.tools.bench import chaos_report as report
from moemesh.tools.bench.chaos_client import StreamRecord, _stream, client_main, prompt_ids


@dataclass(frozen=True)
class SoakLoad:
    url: str
    model: str
    streams: int = 64
    max_tokens: int = 200
    prompt_tokens: int = 64
    duration_s: float = 1200.0
    request_deadline_s: float = 60.0  # one request still open after this is hung


async def _lane(c: httpx.AsyncClient, cfg: SoakLoad, lane: int, stop_at: float, out: list[StreamRecord]) -> None:
    k = 0
    while time.time() < stop_at:
        rec = StreamRecord(lane * 1_000_000 + k, 0)
        out.append(rec)
        body = {"model": cfg.model, "prompt": prompt_ids(rec.i, cfg.prompt_tokens), "stream": True,
                "max_tokens": cfg.max_tokens, "min_tokens": cfg.max_tokens, "ignore_eos": True, "temperature": 0}
        try:
            await asyncio.wait_for(_stream(c, cfg.url, body, rec, cfg.max_tokens + 1, asyncio.Event()),
                                   cfg.request_deadline_s)
        except asyncio.TimeoutError:
            pass  # _stream marked it hung
        if rec.error is not None:
            await asyncio.sleep(0.2)  # a refused request is not retried in a tight loop
        k += 1


async def run(cfg: SoakLoad) -> dict:
    stop_at = time.time() + cfg.duration_s
    recs: list[StreamRecord] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.streams)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as c:
        await asyncio.gather(*(_lane(c, cfg, i, stop_at, recs) for i in range(cfg.streams)))
    streams = [r.out() for r in recs]
    ref = report.reference_text(streams, cfg.max_tokens)
    kinds = Counter(report.outcome(s, cfg.max_tokens, ref) for s in streams)
    unclear = [s for s in streams if report.outcome(s, cfg.max_tokens, ref) in ("short", "wrong", "hung")]
    return {"config": asdict(cfg), "requests": len(streams), "outcomes": {k: kinds[k] for k in report.KINDS},
            "errors": dict(Counter(s["error"] for s in streams if s["error"] is not None)),
            "tokens": sum(s["tokens"] for s in streams), "max_stall_s": max((s["max_gap_s"] for s in streams), default=0),
            "stalls": sorted(((s["gap_end"], s["max_gap_s"]) for s in streams if s["max_gap_s"] > 5.0))[:50],
            "lost_without_clear_error": unclear[:20]}


def main(argv: list[str] | None = None) -> int:
    return client_main(argv, "moemesh.tools.bench.soak_client", SoakLoad, run)


if __name__ == "__main__":
    sys.exit(main())
