"""`moemesh bench idle`."""

from __future__ import annotations

import argparse


def register(bsub) -> None:
    b = bsub.add_parser("idle", help="CPU of each mesh process with nothing to do, and with transfers pending")
    b.add_argument("--model", default="", help="model directory for config and tokenizer (default: tiny)")
    b.add_argument("--mock-step-ms", default="0,20", help="comma-separated mock step times")
    b.add_argument("--seconds", type=float, default=10.0, help="length of each measuring window")
    b.add_argument("--settle-seconds", type=float, default=2.0, help="wait after the warm-up requests")
    b.add_argument("--out", default="bench-results/idle.json", help="JSON file for the results")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import idle
    from moemesh.tools.cli.bench_io import save

    cfg = idle.IdleBenchConfig(model=args.model, seconds=args.seconds, settle_s=args.settle_seconds,
                               mock_step_ms=tuple(float(x) for x in args.mock_step_ms.split(",") if x))
    result = idle.run(cfg)
    print(idle.table(result))
    save(result, args.out)
    return 0
