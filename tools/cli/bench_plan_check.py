"""`moemesh bench plan-check`: the step model of `moemesh plan` against runs on this machine."""

from __future__ import annotations

import argparse
import sys


def register(bsub) -> None:
    from moemesh.tools.cli.bench_io import ints

    b = bsub.add_parser("plan-check", help="the plan's step model against mock and real DEP decode runs here")
    b.add_argument("--model", default="", help="model directory (default: the tiny model)")
    b.add_argument("--deps", type=ints, default=(1, 2, 4), help="DEP widths to run")
    b.add_argument("--batch", type=int, default=16, help="concurrent requests per instance")
    b.add_argument("--isl", type=int, default=128, help="prompt tokens of each request (dummy KV)")
    b.add_argument("--osl", type=int, default=64, help="new tokens of each request")
    b.add_argument("--waves", type=int, default=3, help="requests per DEP run, in --batch's")
    b.add_argument("--repeats", type=int, default=5,
                   help="interleaved rounds of the DEP runs (medians; docs/plan.md validates with 5)")
    b.add_argument("--skew", default="zipf:1.2", help="the workers' router skew for the skewed runs")
    b.add_argument("--mock-step-ms", type=lambda s: tuple(float(x) for x in s.split(",") if x), default=(20.0, 5.0),
                   help="step times of the mock-engine runs, ms")
    b.add_argument("--mock-batches", type=ints, default=(8, 64), help="streams of the mock-engine runs")
    b.add_argument("--mock-seconds", type=float, default=5.0, help="load per mock-engine point")
    b.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    b.add_argument("--seed", type=int, default=0, help="seed of the forward run and the model's samples")
    b.add_argument("--collective-calls", type=int, default=200,
                   help="steps of collectives timed per width and block (three blocks) after the DEP runs")
    b.add_argument("--out", default="bench-results/plan_check.json", help="where the JSON result goes")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import plan_check
    from moemesh.tools.cli.bench_io import save

    try:
        cfg = plan_check.PlanCheckConfig(model=args.model, deps=args.deps, batch=args.batch, isl=args.isl,
                                         osl=args.osl, waves=args.waves,
                                         repeats=args.repeats, skew=args.skew, mock_step_ms=args.mock_step_ms,
                                         mock_batches=args.mock_batches, mock_seconds=args.mock_seconds,
                                         threads=args.threads, seed=args.seed,
                                         collective_calls=args.collective_calls)
    except ValueError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    result = plan_check.run(cfg)
    print(plan_check.table(result))
    save(result, args.out)
    return 0
