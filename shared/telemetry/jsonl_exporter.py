"""A span exporter that appends one JSON object per finished span to a file.

Record layout (ids are lowercase hex, times are Unix nanoseconds):

    {"name": str, "trace_id": str(32), "span_id": str(16), "parent_span_id": str(16) | null,
     "kind": "INTERNAL" | "SERVER" | ..., "start_time_ns": int, "end_time_ns": int,
     "attributes": {...}, "events": [{"name": str, "time_ns": int, "attributes": {...}}],
     "links": [{"trace_id": str, "span_id": str, "attributes": {...}}],
     "status": {"code": "UNSET" | "OK" | "ERROR", "description": str | null},
     "resource": {"service.name": str}}

`moemesh.shared.telemetry.chrome_trace.load_jsonl` reads this layout back.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import format_span_id, format_trace_id


def span_to_dict(span: ReadableSpan) -> dict:
    ctx = span.context
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format_trace_id(ctx.trace_id),
        "span_id": format_span_id(ctx.span_id),
        "parent_span_id": format_span_id(parent.span_id) if parent is not None else None,
        "kind": span.kind.name,
        "start_time_ns": span.start_time,
        "end_time_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
        "links": [{"trace_id": format_trace_id(link.context.trace_id),
                   "span_id": format_span_id(link.context.span_id),
                   "attributes": dict(link.attributes or {})} for link in span.links],
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "resource": {"service.name": span.resource.attributes.get("service.name")},
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends spans to `path`, one line each.

    Each batch goes out in a single `write` on an O_APPEND descriptor: the kernel then keeps
    lines whole even when several services (threads or processes) share one file, and the
    file is complete as soon as `export` returns, with no user-space buffer to flush.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        # default=str: an attribute value that JSON cannot hold must not lose the whole batch.
        data = "".join(json.dumps(span_to_dict(s), default=str, separators=(",", ":")) + "\n"
                       for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
