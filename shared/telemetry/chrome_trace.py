"""Span JSON lines (see `jsonl_exporter`) to Chrome trace-event JSON for Perfetto / chrome://tracing.

Glossary:
    process row  one per service (`pid`), named by a "process_name" metadata event.
    lane         a thread row (`tid`) inside a service. Concurrent requests overlap in time,
                 and the viewers only draw properly nested slices on one thread, so spans are
                 packed into lanes where they nest, a child preferring its parent's lane.
    flow         an arrow from a parent span to its child in another service ("s" → "f").

Times: span records are in Unix ns; trace events are in µs from the earliest span start,
which `otherData.base_time_unix_ns` keeps. Absolute µs would not fit a float to the ns
(2^53 µs is 285 years), and the rounding could push a child out of its parent's slice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

_REQUIRED = {"name": str, "trace_id": str, "span_id": str, "start_time_ns": int, "end_time_ns": int}


def load_jsonl(path: str | os.PathLike) -> tuple[list[dict], int]:
    """Reads span records, skipping lines that are not one (e.g. a line cut off by a crash).

    Returns:
        (spans, num_malformed); blank lines count as neither.
    """
    spans, num_malformed, _ = read_spans(path)
    return spans, num_malformed


def read_spans(path: str | os.PathLike, clamp_inverted: bool = False) -> tuple[list[dict], int, int]:
    """As load_jsonl; with clamp_inverted, a span that ends before it starts (a racy end
    time) is kept with its end set to its start instead of being dropped.

    Returns:
        (spans, num_malformed, num_inverted_kept)
    """
    spans, num_malformed, num_inverted = [], 0, 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                num_malformed += 1
                continue
            if (clamp_inverted and isinstance(rec, dict) and type(rec.get("start_time_ns")) is int
                    and type(rec.get("end_time_ns")) is int and rec["end_time_ns"] < rec["start_time_ns"]):
                rec["end_time_ns"] = rec["start_time_ns"]
                num_inverted += 1
            if _is_span(rec):
                spans.append(rec)
            else:
                num_malformed += 1
    return spans, num_malformed, num_inverted


def _is_span(rec) -> bool:
    if not isinstance(rec, dict):
        return False
    for key, typ in _REQUIRED.items():
        if not isinstance(rec.get(key), typ) or isinstance(rec.get(key), bool):
            return False
    if rec["end_time_ns"] < rec["start_time_ns"] or not isinstance(rec.get("attributes", {}), dict):
        return False
    events = rec.get("events", [])
    return isinstance(events, list) and all(
        isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("time_ns"), int)
        and isinstance(e.get("attributes", {}), dict) for e in events)


def service_of(span: dict) -> str:
    resource = span.get("resource")
    name = resource.get("service.name") if isinstance(resource, dict) else None
    return name if isinstance(name, str) and name else "unknown_service"


def to_chrome_trace(spans: Iterable[dict]) -> dict:
    """Builds the trace-event document; `spans` are records as `load_jsonl` returns them."""
    spans = sorted(spans, key=lambda s: (s["start_time_ns"], -s["end_time_ns"]))
    pid_of = {name: i + 1 for i, name in enumerate(sorted({service_of(s) for s in spans}))}
    tids = _assign_lanes(spans)
    base = spans[0]["start_time_ns"] if spans else 0
    where = {s["span_id"]: (pid_of[service_of(s)], tid, s) for s, tid in zip(spans, tids)}

    meta = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
            for name, pid in pid_of.items()]
    body, num_flows = [], 0
    for s, tid in zip(spans, tids):
        pid = pid_of[service_of(s)]
        ids = {"trace_id": s["trace_id"], "span_id": s["span_id"], "parent_span_id": s.get("parent_span_id")}
        args = {**s.get("attributes", {}), **ids}
        status = s.get("status") or {}
        if status.get("code") not in (None, "UNSET"):
            args["status"] = status.get("code")
            if status.get("description"):
                args["status_description"] = status["description"]
        if s.get("links"):
            args["links"] = s["links"]
        ts = (s["start_time_ns"] - base) / 1000
        x = {"ph": "X", "name": s["name"], "cat": str(s.get("kind", "span")).lower(), "pid": pid, "tid": tid,
             "ts": ts, "dur": (s["end_time_ns"] - s["start_time_ns"]) / 1000, "args": args}
        if args.get("status") == "ERROR":
            x["cname"] = "terrible"  # the viewer's red
        body.append(x)
        for e in s.get("events", []):
            body.append({"ph": "i", "s": "t", "name": e["name"], "cat": "event", "pid": pid, "tid": tid,
                         "ts": (e["time_ns"] - base) / 1000, "args": {**e.get("attributes", {}), **ids}})
        parent = where.get(s.get("parent_span_id"))
        if parent is not None and parent[0] != pid:
            num_flows += 1
            body.extend(_flow(num_flows, parent, (pid, tid, s), base))
    body.sort(key=lambda ev: (ev["ts"], ev["ph"] != "X", -ev.get("dur", 0)))
    return {"traceEvents": meta + body, "displayTimeUnit": "ms", "otherData": {"base_time_unix_ns": base}}


def _flow(flow_id: int, parent: tuple[int, int, dict], child: tuple[int, int, dict], base: int) -> list[dict]:
    (ppid, ptid, p), (cpid, ctid, c) = parent, child
    ts = (c["start_time_ns"] - base) / 1000
    # The start must sit inside the parent's slice for the viewer to bind it there.
    start_ts = (min(max(c["start_time_ns"], p["start_time_ns"]), p["end_time_ns"]) - base) / 1000
    common = {"name": "parent", "cat": "flow", "id": flow_id}
    return [{**common, "ph": "s", "pid": ppid, "tid": ptid, "ts": start_ts},
            {**common, "ph": "f", "bp": "e", "pid": cpid, "tid": ctid, "ts": ts}]


def _assign_lanes(spans: list[dict]) -> list[int]:
    """A tid (from 1) per span; `spans` sorted by (start, -end). Lanes are per service."""
    lanes: dict[str, list[list[int]]] = {}  # service -> lane -> stack of open spans' end times
    lane_of: dict[tuple[str, str], int] = {}
    tids = []
    for s in spans:
        svc, start, end = service_of(s), s["start_time_ns"], s["end_time_ns"]
        svc_lanes = lanes.setdefault(svc, [])
        preferred = lane_of.get((svc, s.get("parent_span_id")))
        for i in ([preferred] if preferred is not None else []) + list(range(len(svc_lanes))):
            stack = svc_lanes[i]
            while stack and stack[-1] <= start:  # later spans start no earlier: these are done
                stack.pop()
            if not stack or stack[-1] >= end:
                break
        else:
            i = len(svc_lanes)
            svc_lanes.append([])
        svc_lanes[i].append(end)
        lane_of[(svc, s["span_id"])] = i
        tids.append(i + 1)
    return tids
