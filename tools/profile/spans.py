"""Span records (the `jsonl_exporter` layout) indexed into one tree per request.

The tree of one request (docs/architecture.md, "Tracing"):

    POST /v1/... (gateway root)
    ├── prefill ── queue.wait, prefill.batch
    │   └── decode ── kv.transfer ── kv.send
    └── stream (first_token event)

In decode-only bench mode there is no prefill span: decode hangs off the root.

Glossary:
    request  a gateway root span ("POST /v1/...") and everything below it. A trace is
             normally one request, but a client that sends its own `traceparent` can put
             several requests in one trace, so requests are cut by root, not by trace id.
    orphan   a span whose chain of parents never reaches a root: the root is not in the
             file yet (the request is still in flight, since the gateway's span ends last)
             or it was lost. A trace's orphans form one rootless request, so whatever
             phases they hold can still be counted as partial.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

from moemesh.shared.telemetry.chrome_trace import read_spans

ROOT_PREFIX = "POST "  # the gateway names its request span after the HTTP route


@dataclass
class RequestSpans:
    """The spans of one request that the breakdown reads; any may be missing."""

    trace_id: str
    root: dict | None = None
    prefill: dict | None = None
    queue: dict | None = None
    prefill_batch: dict | None = None
    decode: dict | None = None
    kv_transfer: dict | None = None
    kv_send: dict | None = None
    stream: dict | None = None

    @property
    def request_id(self) -> str | None:
        for s in (self.root, self.prefill, self.decode):
            rid = attr(s, "request.id")
            if isinstance(rid, str):
                return rid
        return None

    @property
    def decode_only(self) -> bool:
        """Decode from a dummy KV (bench mode): no prefill, queue or transfer to expect."""
        if self.decode is None or self.prefill is not None:
            return False
        return bool(attr(self.decode, "bench.dummy_kv")) or (
            self.root is not None and self.decode.get("parent_span_id") == self.root["span_id"])


def attr(span: dict | None, key: str, default=None):
    if span is None:
        return default
    attrs = span.get("attributes")
    return attrs.get(key, default) if isinstance(attrs, dict) else default


def duration_ns(span: dict | None) -> int | None:
    return None if span is None else span["end_time_ns"] - span["start_time_ns"]


def load(path: str | os.PathLike) -> tuple[list[dict], int, int]:
    """Span records, keeping inverted ones: a span that ends before it starts is a real
    span with a racy end time, clamped to take no time rather than losing its phase.

    Returns:
        (spans, num_malformed, num_inverted)
    """
    return read_spans(path, clamp_inverted=True)


def started_between(spans: list[dict], t0_ns: int, t1_ns: int) -> list[dict]:
    return [s for s in spans if t0_ns <= s["start_time_ns"] <= t1_ns]


def is_root(span: dict) -> bool:
    return span["name"].startswith(ROOT_PREFIX)


def index_requests(spans: list[dict]) -> list[RequestSpans]:
    """Groups spans into requests, ordered by start time; never raises on a broken tree."""
    by_id = {(s["trace_id"], s["span_id"]): s for s in spans}
    owner: dict[tuple[str, str], tuple[str, str]] = {}  # span key -> request key

    def request_key(s: dict) -> tuple[str, str]:
        path, cur = [], s
        key = ("orphan", s["trace_id"])
        while cur is not None:
            k = (cur["trace_id"], cur["span_id"])
            if k in owner:
                key = owner[k]
                break
            if k in path:  # a cycle: ids repeated across records; give up on the chain
                break
            path.append(k)
            if is_root(cur):
                key = k
                break
            cur = by_id.get((cur["trace_id"], cur.get("parent_span_id")))
        for k in path:
            owner[k] = key
        return key

    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for s in spans:
        groups[request_key(s)].append(s)
    reqs = [_select(key, group) for key, group in groups.items()]
    reqs.sort(key=lambda r: min((s["start_time_ns"] for s in (r.root, r.prefill, r.decode) if s), default=0))
    return reqs


def _select(key: tuple[str, str], group: list[dict]) -> RequestSpans:
    named: dict[str, list[dict]] = defaultdict(list)
    for s in group:
        named[s["name"]].append(s)
    root = None if key[0] == "orphan" else next(s for s in group if (s["trace_id"], s["span_id"]) == key)
    req = RequestSpans(trace_id=group[0]["trace_id"], root=root)
    # A retried request can leave several decode (or prefill) spans: the one that finished
    # is the one whose time the client saw.
    req.decode = _last(named["decode"], prefer=lambda s: attr(s, "finish.reason") is not None)
    req.kv_transfer = _last(_children(named["kv.transfer"], req.decode))
    req.kv_send = _last(_children(named["kv.send"], req.kv_transfer))
    parent_of_decode = [s for s in named["prefill"]
                        if req.decode is not None and s["span_id"] == req.decode.get("parent_span_id")]
    req.prefill = _last(parent_of_decode or named["prefill"])
    req.queue = _last(_children(named["queue.wait"], req.prefill))
    req.prefill_batch = _last(_children(named["prefill.batch"], req.prefill))
    req.stream = _last(_children(named["stream"], root) if root is not None else named["stream"])
    return req


def _children(spans: list[dict], parent: dict | None) -> list[dict]:
    if parent is None:
        return []
    return [s for s in spans if s.get("parent_span_id") == parent["span_id"]]


def _last(spans: list[dict], prefer=None) -> dict | None:
    if prefer is not None and any(prefer(s) for s in spans):
        spans = [s for s in spans if prefer(s)]
    return max(spans, key=lambda s: s["end_time_ns"], default=None)
