"""Synthetic span records in the jsonl_exporter layout, with times in ms from a base."""

from __future__ import annotations

import json
from pathlib import Path

BASE_NS = 1_700_000_000_000_000_000


def ns(ms: float) -> int:
    return BASE_NS + round(ms * 1e6)


class Trace:
    """Builds span dicts; ids are counters, so each test's spans are reproducible."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self._next = 0

    def span(self, name: str, trace: str, start_ms: float, end_ms: float, parent: dict | None = None,
             service: str = "moemesh-gateway", attrs: dict | None = None, events: list | None = None,
             status: str = "UNSET") -> dict:
        self._next += 1
        rec = {"name": name, "trace_id": trace.rjust(32, "0"), "span_id": f"{self._next:016x}",
               "parent_span_id": parent["span_id"] if parent else None, "kind": "INTERNAL",
               "start_time_ns": ns(start_ms), "end_time_ns": ns(end_ms), "attributes": dict(attrs or {}),
               "events": [{"name": n, "time_ns": ns(t), "attributes": a} for n, t, a in (events or [])],
               "links": [], "status": {"code": status, "description": None},
               "resource": {"service.name": service}}
        self.records.append(rec)
        return rec

    def write(self, path: Path) -> Path:
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        return path


def step(t_ms: float, seqs: int, fwd: float, host: float, wait: float = 0.0, tokens: int = 1) -> tuple:
    return ("step", t_ms, {"tokens": tokens, "batch.num_seqs": seqs, "forward_ms": fwd, "host_ms": host,
                           "rank_wait_ms": wait})


def full_request(tr: Trace, trace: str, t0: float, *, queue: float = 5.0, prefill: float = 10.0,
                 kv: float = 4.0, decode: float = 72.0, stream: float = 5.0, steps=(), worker: str = "decode-a",
                 skip: tuple[str, ...] = ()) -> dict:
    """One disaggregated request; `skip` names spans to leave out. Returns the spans by name.

    Layout (ms from t0): dispatch 3 before the queue, hand-off 1 after the prefill, so
    e2e = 3 + queue + prefill + 1 + kv + decode + stream and other = 4.
    """
    q0 = t0 + 3
    p0 = q0 + queue
    d0 = p0 + prefill + 1
    d1 = d0 + kv + decode
    end = d1 + stream
    out: dict = {}
    root = out["root"] = tr.span("POST /v1/completions", trace, t0, end,
                                 attrs={"request.id": f"r-{trace}", "prompt.tokens": 7, "http.status_code": 200})
    if "prefill" not in skip:
        pre = out["prefill"] = tr.span("prefill", trace, t0 + 2, p0 + prefill, root, "moemesh-prefill",
                                       {"request.id": f"r-{trace}", "prompt.tokens": 7})
        if "queue.wait" not in skip:
            out["queue.wait"] = tr.span("queue.wait", trace, q0, p0, pre, "moemesh-prefill")
        if "prefill.batch" not in skip:
            out["prefill.batch"] = tr.span("prefill.batch", trace, p0, p0 + prefill, pre, "moemesh-prefill",
                                           {"batch.num_tokens": 7, "batch.num_seqs": 1})
    if "decode" not in skip:
        dec = out["decode"] = tr.span("decode", trace, d0, d1, out.get("prefill", root), "moemesh-decode",
                                      {"request.id": f"r-{trace}", "worker.id": worker, "decode.steps": len(steps),
                                       "finish.reason": "length"}, events=list(steps))
        if "kv.transfer" not in skip:
            kvs = out["kv.transfer"] = tr.span("kv.transfer", trace, d0, d0 + kv, dec, "moemesh-decode",
                                               {"kv.bytes": 4096, "kv.seconds": kv / 1e3})
            out["kv.send"] = tr.span("kv.send", trace, d0 + 0.5, d0 + kv - 0.5, kvs, "moemesh-prefill")
    if "stream" not in skip:
        out["stream"] = tr.span("stream", trace, t0 + 1, end, root, attrs={"completion.tokens": 3},
                                events=[("first_token", p0 + prefill + 0.5, {})])
    return out
