"""`moemesh bench chaos`."""

from __future__ import annotations

import argparse
import sys


def register(bsub) -> None:
    from moemesh.tools.bench.chaos_scenarios import SCENARIOS

    b = bsub.add_parser("chaos", help="fault scenarios on a local mesh (workers, gateway or NATS killed, a drain "
                                      "past its timeout): streams completed, migrated, errored, hung, tokens lost")
    b.add_argument("--scenario", default="all",
                   help=f"comma-separated, or all (default): {', '.join(SCENARIOS)}")
    b.add_argument("--model", default="", help="model directory for config and tokenizer (default: tiny)")
    b.add_argument("--streams", type=int, default=100, help="concurrent streams")
    b.add_argument("--max-tokens", type=int, default=200, help="output tokens per stream")
    b.add_argument("--prompt-tokens", type=int, default=64, help="prompt ids per stream")
    b.add_argument("--ready-tokens", type=int, default=20,
                   help="a mid-stream fault strikes once every stream has this many tokens")
    b.add_argument("--mock-step-ms", type=float, default=20.0, help="the mock engine's step time")
    b.add_argument("--deadline-s", type=float, default=30.0,
                   help="after the fault (and any outage): a stream still open then counts as hung")
    b.add_argument("--probe-rate", type=float, default=5.0, help="new requests a second for 5 s after the fault")
    b.add_argument("--log-dir", default="", help="services' logs (default: ~/.cache/moemesh/runs/chaos-...)")
    b.add_argument("--out", default="bench-results/chaos.json", help="JSON file for the results")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import chaos
    from moemesh.tools.cli.bench_io import save

    names = tuple(chaos.SCENARIOS) if args.scenario == "all" else tuple(s for s in args.scenario.split(",") if s)
    try:
        cfg = chaos.ChaosConfig(model=args.model, scenarios=names, streams=args.streams, max_tokens=args.max_tokens,
                                prompt_tokens=args.prompt_tokens, ready_tokens=args.ready_tokens,
                                mock_step_ms=args.mock_step_ms,
                                deadline_s=args.deadline_s, probe_rate=args.probe_rate, log_dir=args.log_dir)
    except ValueError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    result = chaos.run(cfg)
    print(chaos.table(result))
    save(result, args.out)
    return 0
