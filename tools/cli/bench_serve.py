"""`moemesh bench serve`: load an OpenAI-compatible server and report serving metrics."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

# Per workload: (ISL, OSL). For prefix, ISL is the unique suffix after the shared prefix;
# for agentic, ISL is the first turn's prompt.
_DEFAULT_LENGTHS = {
    "random": ("uniform:128-1024", "uniform:32-256"),
    "fixed": ("512", "128"),
    "prefix": ("uniform:32-256", "uniform:32-256"),
    "agentic": ("uniform:512-2048", "uniform:64-256"),
    "dataset": ("1", "uniform:32-256"),  # ISL: the file's; OSL: where the file has none
    "trace": ("1", "1"),  # both the trace's
}


def register(bsub) -> None:
    s = bsub.add_parser("serve", help="serving benchmark against any OpenAI-compatible server",
                        description="Streams requests to URL and reports TTFT, TPOT, ITL, end-to-end "
                                    "latency, throughput and goodput. See docs/benchmarks.md.")
    s.add_argument("--url", required=True, help="server base URL, e.g. http://localhost:8000")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions", help="which API to call")
    s.add_argument("--model", default=None, help="model name to send (default: first of /v1/models)")
    s.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    s.add_argument("--tokenizer", default=None, metavar="MODEL_DIR",
                   help="tokenizer.json (or its directory) for exact prompt lengths (tokens are counted "
                        "from the server's usage, never by tokenizing its output)")
    s.add_argument("--words-per-token", type=float, default=1.0,
                   help="length estimate without --tokenizer (default 1.0 for the built-in word list)")
    s.add_argument("--workload", choices=list(_DEFAULT_LENGTHS), default="random",
                   help="request stream shape (dataset: prompts from --dataset-path; trace: a replay of --trace)")
    s.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="with --workload dataset: JSONL ({\"prompt\": ..., \"output_len\": ...} per line) "
                        "or a ShareGPT JSON file")
    s.add_argument("--trace", action="append", default=[], metavar="FILE",
                   help="with --workload trace: a Mooncake JSONL trace (timestamp, input_length, output_length, "
                        "hash_ids) or a kv-cache-tester JSON session; repeat for concurrent sessions. "
                        "Needs --tokenizer")
    s.add_argument("--trace-block-size", type=int, default=None,
                   help="tokens each hash id covers (default: the trace's own; Mooncake's 512)")
    s.add_argument("--trace-scale", default="auto", metavar="auto|F",
                   help="divide every trace length by F, a power of two, keeping which blocks requests share "
                        "(auto: the smallest that fits the server's max_model_len)")
    s.add_argument("--time-scale", type=float, default=1.0,
                   help="trace replay speed: 2 sends its requests at half its times")
    s.add_argument("--isl", default=None,
                   help="input length: N, uniform:LO-HI, normal:MEAN,STD, lognormal:MEDIAN,SIGMA")
    s.add_argument("--osl", default=None, help="output length (max_tokens), same forms as --isl")
    s.add_argument("--num-requests", type=int, default=None,
                   help="per point (random, fixed, prefix; default 100); trace: its first N (default all)")
    s.add_argument("--num-prefix-groups", type=int, default=4,
                   help="prefix workload: groups of requests that share a prefix")
    s.add_argument("--prefix-len", type=int, default=1024, help="tokens of each group's shared prefix")
    s.add_argument("--num-sessions", type=int, default=8, help="agentic sessions per point")
    s.add_argument("--turns", default="4", help="agentic turns per session, same forms as --isl")
    s.add_argument("--tool-len", default="uniform:128-512", help="agentic tool-output tokens added per turn")
    s.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (inf: all at once)")
    s.add_argument("--concurrency", type=int, default=None,
                   help="sessions in flight; with --rate, a cap on them")
    s.add_argument("--sweep", default=None, metavar="concurrency=1,4,16|rate=1,2,4",
                   help="one measured point per value")
    s.add_argument("--warmup", type=int, default=0, help="requests sent first and not counted")
    s.add_argument("--seed", type=int, default=0, help="the same seed and config give the same request stream")
    s.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput target for time to first token")
    s.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput target for time per output token")
    s.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so outputs run to max_tokens (a common server extension)")
    s.add_argument("--stream-usage", action=argparse.BooleanOptionalAction, default=True,
                   help="send stream_options.include_usage to get exact token counts")
    s.add_argument("--continuous-usage", action=argparse.BooleanOptionalAction, default=True,
                   help="also ask for usage on every chunk (stream_options.continuous_usage_stats) "
                        "to count each chunk's tokens exactly")
    s.add_argument("--worker-header", default="x-moemesh-worker",
                   help="response header naming the worker that served a request ('' to ignore)")
    s.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature to send (default: the server's)")
    s.add_argument("--priority-mix", type=float, default=0.0, metavar="F",
                   help="send this share of requests (sessions) at --high-priority (vLLM's priority field), the rest "
                        "in the default class; the report then gives TTFT, ITL and 429s per class")
    s.add_argument("--high-priority", type=int, default=-1,
                   help="the priority sent with --priority-mix (lower is served earlier; default -1)")
    s.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    s.add_argument("--timeout-s", type=float, default=600.0, help="connect/read timeout per request")
    s.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="recorded in the result's config, e.g. skew=zipf0.69 (repeatable)")
    s.add_argument("--nats-url", default="",
                   help="a moemesh server's NATS: add where each point's requests spent their time on the workers "
                        "(queue, prefill, the hand-off to decode and its phases), with tracing off")
    s.add_argument("--subject-prefix", default="mm", help="with --nats-url: the mesh's NATS subject prefix")
    s.add_argument("--out-dir", default=None, help="default bench-results/serve-<timestamp>")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=run)


def parse_sweep(spec: str) -> tuple[str, tuple[float, ...]]:
    mode, _, vals = spec.partition("=")
    if mode not in ("concurrency", "rate") or not vals:
        raise ValueError(f"--sweep takes concurrency=V1,V2,... or rate=V1,V2,..., got {spec!r}")
    try:
        return mode, tuple(float(v) for v in vals.split(",") if v)
    except ValueError:
        raise ValueError(f"bad --sweep values in {spec!r}") from None


def parse_labels(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ValueError(f"--label takes KEY=VALUE, got {item!r}")
        out[k] = v
    return out


def build_config(args: argparse.Namespace):
    from moemesh.tools.bench.serve.client import ClientConfig
    from moemesh.tools.bench.serve.runner import ServeBenchConfig
    from moemesh.tools.bench.serve.workload import LengthDist, WorkloadConfig

    isl, osl = _DEFAULT_LENGTHS[args.workload]
    if args.trace_scale != "auto" and not args.trace_scale.isdigit():
        raise ValueError(f"--trace-scale takes auto or a power of two, got {args.trace_scale!r}")
    workload = WorkloadConfig(
        kind=args.workload, num_requests=100 if args.num_requests is None else args.num_requests,
        num_requests_set=args.num_requests is not None,
        isl=LengthDist.parse(args.isl or isl),
        osl=LengthDist.parse(args.osl or osl), num_prefix_groups=args.num_prefix_groups,
        prefix_len=args.prefix_len, num_sessions=args.num_sessions, turns=LengthDist.parse(args.turns),
        tool_len=LengthDist.parse(args.tool_len), words_per_token=args.words_per_token,
        dataset_path=args.dataset_path, trace_paths=tuple(args.trace), trace_block_size=args.trace_block_size,
        trace_scale=0 if args.trace_scale == "auto" else int(args.trace_scale), priority_mix=args.priority_mix,
        high_priority=args.high_priority)
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    client = ClientConfig(
        url=args.url, endpoint=args.endpoint, model=args.model, ignore_eos=args.ignore_eos,
        stream_usage=args.stream_usage, continuous_usage=args.continuous_usage, api_key=args.api_key,
        timeout_s=args.timeout_s,
        worker_header=args.worker_header, temperature=args.temperature, extra_body=extra)
    if args.workload == "trace":
        if args.sweep or args.rate is not None or args.concurrency is not None:
            raise ValueError("the trace workload replays at its own times: give --time-scale, not --rate, "
                             "--concurrency or --sweep")
        mode, values = "trace", (args.time_scale,)
    elif args.sweep:
        mode, values = parse_sweep(args.sweep)
        if mode == "concurrency" and args.rate is not None:
            raise ValueError("--rate cannot be combined with a concurrency sweep")
    elif args.rate is not None:
        mode, values = "rate", (args.rate,)
    else:
        mode, values = "concurrency", (float(args.concurrency or 1),)
    return ServeBenchConfig(
        client=client, workload=workload, mode=mode, values=values,
        max_concurrency=args.concurrency if mode == "rate" else None, warmup=args.warmup,
        seed=args.seed, tokenizer=args.tokenizer, slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms, labels=parse_labels(args.label), progress=not args.no_progress,
        nats_url=args.nats_url, subject_prefix=args.subject_prefix)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench.serve import report, runner

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request drowns the progress bar
    try:
        cfg = build_config(args)
        result = runner.run(cfg)
    except ValueError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    out_dir = args.out_dir or f"bench-results/serve-{time.strftime('%Y%m%d-%H%M%S')}"
    paths = report.write_all(result, out_dir)
    print(report.table(result))
    if prio := report.priority_lines(result):
        print("\n".join(["", *prio]))
    for p in result["points"]:
        if p.get("trace"):
            print("\n".join(report.trace_lines(p)))
    for p in result["points"]:
        ph = p.get("server_phases")
        if ph:
            print(f"{p['mode']}={p['value']:g} server phases: "
                  + (ph["error"] if "error" in ph else report.request_phases.line(ph)))
    print(f"saved {', '.join(str(p) for p in paths)}", file=sys.stderr)
    # Failed requests are results, not crashes; only a run where nothing succeeded fails.
    return 0 if any(p["summary"]["num_ok"] for p in result["points"]) else 1
