"""`moemesh trace export SPANS.jsonl`: span JSON lines to a Chrome trace for Perfetto."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("trace", help="work with recorded traces")
    tsub = p.add_subparsers(dest="trace", required=True)
    e = tsub.add_parser("export", help="span JSON lines to Chrome trace-event JSON (Perfetto, chrome://tracing)")
    e.add_argument("input", help="JSON-lines file written by the services' span exporter")
    e.add_argument("-o", "--out", default=None, help="output file, '-' for stdout (default: INPUT with .trace.json)")
    e.add_argument("--trace-id", default=None, help="keep only this trace (32 hex digits)")
    e.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from moemesh.shared.telemetry.chrome_trace import load_jsonl, service_of, to_chrome_trace

    src = Path(args.input)
    if not src.is_file():
        print(f"moemesh: error: {src} does not exist or is not a file", file=sys.stderr)
        return 2
    spans, num_malformed = load_jsonl(src)
    if num_malformed:
        print(f"moemesh: warning: skipped {num_malformed} malformed line(s) in {src}", file=sys.stderr)
    if args.trace_id is not None:
        want = args.trace_id.strip().lower()
        spans = [s for s in spans if s["trace_id"].lower() == want]
        if not spans:
            print(f"moemesh: error: no spans with trace id {args.trace_id} in {src}", file=sys.stderr)
            return 2
    doc = json.dumps(to_chrome_trace(spans))
    if args.out == "-":
        print(doc)
        return 0
    out = Path(args.out) if args.out else src.with_suffix(".trace.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc + "\n")
    num_services = len({service_of(s) for s in spans})
    num_traces = len({s["trace_id"] for s in spans})
    print(f"wrote {len(spans)} spans ({num_traces} traces, {num_services} services) to {out}", file=sys.stderr)
    return 0
