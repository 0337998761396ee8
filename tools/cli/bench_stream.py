"""`moemesh bench stream`."""

from __future__ import annotations

import argparse
import sys


def register(bsub) -> None:
    from moemesh.shared.config.common import EXPERT_PLACEMENTS
    from moemesh.tools.cli.bench_io import ints

    b = bsub.add_parser("stream", help="host overhead of the serving path on the mock engine: share of the ideal "
                                       "tokens/s, CPU us per token of each mesh process")
    b.add_argument("--model", default="", help="model directory for config and tokenizer (default: tiny)")
    b.add_argument("--streams", type=ints, default=(8, 64, 256), help="concurrent streams, one point each")
    b.add_argument("--seconds", type=float, default=20.0, help="load per point")
    b.add_argument("--osl", type=int, default=256, help="output tokens per request")
    b.add_argument("--mock-step-ms", type=float, default=20.0, help="the mock engine's step time")
    b.add_argument("--warmup-seconds", type=float, default=2.0, help="warm-up load before the first point (0: none)")
    b.add_argument("--spec-tokens", type=int, default=0, help="the mock drafts K tokens a step (0: no draft head)")
    b.add_argument("--accept-rate", type=float, default=0.7, help="each mock draft's chance of being accepted")
    b.add_argument("--dep", type=int, default=1, help="ranks of the decode instance: a DEP-N instance of mock ranks")
    b.add_argument("--skew", default="", help="with --dep: target routing skew, e.g. zipf:1.2")
    b.add_argument("--draft-skew", default="", help="with --dep: the draft head's routing skew")
    b.add_argument("--expert-share", type=float, default=0.5,
                   help="with --dep: the part of a mock step that scales with a rank's expert load")
    b.add_argument("--expert-placement", default="linear", choices=EXPERT_PLACEMENTS,
                   help="with --dep: the start-up placement of experts over the ranks")
    b.add_argument("--rebalance", action="store_true",
                   help="with --dep: run the points again after one live rebalance by the balancer")
    b.add_argument("--settle-s", type=float, default=8.0,
                   help="with --rebalance: load after the move before the points run again (a fresh window)")
    b.add_argument("--trace-file", default="",
                   help="tracing on: every service's spans to this JSON-lines file (what tracing costs)")
    b.add_argument("--out", default="bench-results/stream.json", help="JSON file for the results")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import stream
    from moemesh.tools.cli.bench_io import save

    try:
        cfg = stream.StreamBenchConfig(model=args.model, streams=args.streams, seconds=args.seconds, osl=args.osl,
                                       mock_step_ms=args.mock_step_ms, warmup_s=args.warmup_seconds,
                                       spec_tokens=args.spec_tokens, accept_rate=args.accept_rate,
                                       dep=args.dep, skew=args.skew, draft_skew=args.draft_skew,
                                       rebalance=args.rebalance, expert_share=args.expert_share,
                                       expert_placement=args.expert_placement,
                                       settle_s=args.settle_s, trace_file=args.trace_file)
    except ValueError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    result = stream.run(cfg)
    print(stream.table(result))
    save(result, args.out)
    return 0
