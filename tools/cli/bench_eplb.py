"""`moemesh bench eplb`."""

from __future__ import annotations

import argparse


def register(bsub) -> None:
    b = bsub.add_parser("eplb", help="live DEP instance: balance ratio, move cost and step times under skew")
    b.add_argument("--model", default="", help="model directory (default: the tiny model)")
    b.add_argument("--ranks", type=int, default=2, help="decode DEP ranks")
    b.add_argument("--redundant", type=int, default=1, help="redundant expert slots per rank")
    b.add_argument("--skew", default="zipf:1.2", help="target routing skew, e.g. zipf:0.69 or hot:3,7:2.0")
    b.add_argument("--draft-skew", default="hot:1,9:3.0", help="routing skew of the MTP draft head")
    b.add_argument("--concurrency", type=int, default=16, help="streams in flight")
    b.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    b.add_argument("--warmup-s", type=float, default=20.0, help="seconds of load before the first window")
    b.add_argument("--window-s", type=float, default=15.0, help="seconds per measured window")
    b.add_argument("--rebalances", type=int, default=2, help="live rebalances to run and measure")
    b.add_argument("--seed", type=int, default=0, help="seed of prompts and skew")
    b.add_argument("--out", default="bench-results/eplb.json", help="JSON file for the results")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import eplb_live
    from moemesh.tools.cli.bench_io import save

    cfg = eplb_live.EplbBenchConfig(
        model=args.model, ranks=args.ranks, redundant=args.redundant, skew=args.skew, draft_skew=args.draft_skew,
        concurrency=args.concurrency, max_tokens=args.max_tokens, warmup_s=args.warmup_s, window_s=args.window_s,
        rebalances=args.rebalances, seed=args.seed)
    result = eplb_live.run(cfg)
    print(eplb_live.table(result))
    save(result, args.out)
    return 0
