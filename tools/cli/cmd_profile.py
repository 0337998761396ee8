"""`moemesh profile`: where serving time goes, from span traces and bench results.

    moemesh profile TRACE.jsonl                      per-request and per-step breakdown
    moemesh profile --overhead DECODE.json [--forward FORWARD.json]
                                                     serving overhead vs batch, and its parts
    moemesh profile --live --nats-url URL --trace-file F --seconds N
                                                     breakdown of the spans started in the next N s
    moemesh profile --request-files                  the project files one streamed chat request passes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("profile", help="per-request and per-step time breakdown, and the serving overhead")
    p.add_argument("trace", nargs="?", default=None, help="span JSON-lines file written with --trace-file")
    p.add_argument("--overhead", metavar="DECODE.json", default=None, help="a `moemesh bench decode` result")
    p.add_argument("--forward", metavar="FORWARD.json", default=None,
                   help="a `moemesh bench forward` result to compute the overhead against")
    p.add_argument("--min-batch", type=int, default=8, help="headline overhead over batches from this")
    p.add_argument("--max-batch", type=int, default=256, help="... up to this")
    p.add_argument("--live", action="store_true", help="watch a running mesh for --seconds, then profile")
    p.add_argument("--nats-url", default=None, help="live: the mesh's NATS (lists the workers seen)")
    p.add_argument("--prefix", default="mm", help="live: NATS subject prefix")
    p.add_argument("--trace-file", default=None, help="live: the trace file the services write")
    p.add_argument("--seconds", type=float, default=30.0, help="live: how long to watch")
    p.add_argument("--grace", type=float, default=2.0, help="live: wait this long after the window for spans "
                                                            "of requests still in flight to land")
    p.add_argument("--request-files", action="store_true",
                   help="run one streamed chat request through a mesh in this process and list the project "
                        "files it passes (docs/architecture.md's count)")
    p.add_argument("--model", default=None, help="request files: the model (default: the tiny one, made if missing)")
    p.add_argument("--transport", choices=("ucx", "loopback"), default="ucx", help="request files: the KV transport")
    p.add_argument("--out", default=None, help="JSON result ('' for none; default bench-results/profile.json, "
                                               "or bench-results/request-files.json with --request-files)")
    p.add_argument("--png", default=None, help="chart (default: --out with .png)")
    p.set_defaults(func=run)


def _err(msg: str) -> int:
    print(f"moemesh: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.request_files:
        from moemesh.tools.profile import request_files
        out = "bench-results/request-files.json" if args.out is None else args.out
        request_files.run(args.model, out, args.transport)
        return 0
    if args.out is None:
        args.out = "bench-results/profile.json"
    from moemesh.tools.profile import breakdown, overhead, report, spans as sp

    if args.live and (not args.nats_url or not args.trace_file):
        return _err("--live needs --nats-url and --trace-file")
    trace = args.trace_file if args.live else args.trace
    if trace is None and args.overhead is None:
        return _err("give a trace file, --live, or --overhead DECODE.json")
    if args.forward and not args.overhead:
        return _err("--forward goes with --overhead")
    out: dict = {"source": {"trace": trace, "overhead": args.overhead, "forward": args.forward}}
    texts, req_s, step_s, ovh = [], None, None, None

    if args.overhead:
        try:
            dec = json.loads(Path(args.overhead).read_text())
            fwd = json.loads(Path(args.forward).read_text()) if args.forward else None
            ovh = overhead.analyse(dec, fwd, args.min_batch, args.max_batch)
        except (OSError, ValueError, TypeError, KeyError) as e:
            return _err(f"cannot read the bench results: {e}")
        out["overhead"] = ovh

    if trace is not None:
        window = None
        if args.live:
            try:
                window, workers = asyncio.run(_watch(args.nats_url, args.prefix, args.seconds, args.grace))
            except Exception as e:  # nats raises several unrelated types for an unreachable server
                return _err(f"cannot watch the mesh at {args.nats_url}: {type(e).__name__}: {e}")
            out["live"] = {"start_ns": window[0], "end_ns": window[1], "workers": workers}
            texts.append(f"watched {args.seconds:g} s; workers seen: "
                         + (", ".join(f"{w} ({r})" for w, r in sorted(workers.items())) or "none"))
        if not Path(trace).is_file():
            return _err(f"{trace} does not exist or is not a file")
        spans, num_malformed, num_inverted = sp.load(trace)
        if num_malformed:
            print(f"moemesh: warning: skipped {num_malformed} malformed line(s) in {trace}", file=sys.stderr)
        if num_inverted:
            print(f"moemesh: note: {num_inverted} span(s) ended before they started; counted as taking 0 ms",
                  file=sys.stderr)
        if window is not None:
            spans = sp.started_between(spans, *window)
        rows = [breakdown.request_phases(r) for r in sp.index_requests(spans)]
        steps, num_events = breakdown.steps_from_spans(spans)
        req_s, step_s = breakdown.summarize_requests(rows), breakdown.summarize_steps(steps, num_events)
        out |= {"num_spans": len(spans), "num_malformed_lines": num_malformed, "num_inverted_spans": num_inverted,
                "requests": req_s, "steps": step_s,
                "per_request": [_row_json(r) for r in rows]}
        texts += [report.requests_table(req_s), report.steps_table(step_s)]
    if ovh is not None:
        texts.append(report.overhead_table(ovh))
    print("\n\n".join(texts))

    have_req = req_s is not None and req_s["num_complete"] > 0
    have_steps = step_s is not None and step_s["num_steps"] > 0
    have_ovh = ovh is not None and any(r["points"] for r in ovh["runs"])
    png = Path(args.png) if args.png else (Path(args.out).with_suffix(".png") if args.out else None)
    if png is not None and (have_req or have_steps or have_ovh):
        report.plot(png, req_s if have_req else None, step_s if have_steps else None, ovh if have_ovh else None)
        print(f"wrote {png}", file=sys.stderr)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0 if (have_req or have_steps or have_ovh) else 1


def _row_json(r) -> dict:
    return {"trace_id": r.trace_id, "request_id": r.request_id, "complete": r.complete, "reason": r.reason,
            "decode_only": r.decode_only, "e2e_ms": r.e2e_ms, "ttft_ms": r.ttft_ms, "phases_ms": r.phases,
            "decode_steps": r.decode_steps, "completion_tokens": r.completion_tokens}


async def _watch(nats_url: str, prefix: str, seconds: float, grace: float) -> tuple[tuple[int, int], dict]:
    """Waits out the window while noting which workers heartbeat; returns ((start, end) ns, workers)."""
    import nats

    from moemesh.shared.protocol.messages import Heartbeat, ProtocolError, decode
    from moemesh.shared.protocol.subjects import Subjects

    nc = await nats.connect(nats_url, connect_timeout=5, allow_reconnect=False)
    workers: dict[str, str] = {}

    async def on_hb(msg) -> None:
        try:
            hb = decode(msg.data, Heartbeat)
        except ProtocolError:
            return
        workers[hb.worker_id] = hb.role

    try:
        await nc.subscribe(Subjects(prefix).heartbeat_all, cb=on_hb)
        await nc.flush()  # the server has the subscription before the window is announced
        start = time.time_ns()
        print(f"profiling: watching {nats_url} for {seconds:g} s; run the load now", file=sys.stderr)
        await asyncio.sleep(seconds)
        end = time.time_ns()
        await asyncio.sleep(grace)  # spans end (and are written) after they start
    finally:
        await nc.close()
    return (start, end), workers
