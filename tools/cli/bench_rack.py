"""`moemesh bench rack`."""

from __future__ import annotations

import argparse
import sys


def register(bsub) -> None:
    from moemesh.tools.bench.rack_scenarios import SCENARIOS

    b = bsub.add_parser("rack", help="the mesh across three hosts (network namespaces; needs root) with a NATS "
                                     "cluster of three, and rack faults: a DEP rank killed or stopped, a host's "
                                     "data plane cut, a NATS node or a whole host killed")
    b.add_argument("--scenario", default="all", help=f"comma-separated, or all (default): {', '.join(SCENARIOS)}")
    b.add_argument("--model", default="", help="model directory (default: tiny)")
    b.add_argument("--real", action="store_true", help="the real model forward instead of the mock engine")
    b.add_argument("--streams", type=int, default=100, help="concurrent streams")
    b.add_argument("--max-tokens", type=int, default=200, help="output tokens per stream")
    b.add_argument("--prompt-tokens", type=int, default=64, help="prompt ids per stream")
    b.add_argument("--ready-tokens", type=int, default=20, help="the fault strikes once every stream has this many tokens")
    b.add_argument("--mock-step-ms", type=float, default=20.0, help="the mock engine's step time")
    b.add_argument("--second-dep", type=int, default=1, help="ranks of host 3's decode instance (1 or 2)")
    b.add_argument("--deadline-s", type=float, default=30.0, help="after the fault: a stream still open then is hung")
    b.add_argument("--probe-rate", type=float, default=5.0, help="new requests a second for 5 s after the fault")
    b.add_argument("--dp-timeout-s", type=float, default=5.0, help="a DEP rank's collectives give up after this")
    b.add_argument("--soak-min", type=float, default=0.0,
                   help="instead of one rack per scenario: one rack under a steady load for this many minutes, "
                        "a fault every --soak-every-s (the scenarios in turn), each healed and restarted")
    b.add_argument("--soak-every-s", type=float, default=120.0, help="soak: seconds between faults")
    b.add_argument("--soak-streams", type=int, default=64, help="soak: concurrent streams")
    b.add_argument("--log-dir", default="", help="services' logs (default: ~/.cache/moemesh/runs/rack-...)")
    b.add_argument("--out", default="bench-results/rack.json", help="JSON file for the results")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import rack
    from moemesh.tools.cli.bench_io import save

    names = tuple(rack.SCENARIOS) if args.scenario == "all" else tuple(s for s in args.scenario.split(",") if s)
    try:
        cfg = rack.RackConfig(model=args.model, scenarios=names, streams=args.streams, max_tokens=args.max_tokens,
                              prompt_tokens=args.prompt_tokens, ready_tokens=args.ready_tokens,
                              mock_step_ms=args.mock_step_ms, real=args.real, second_dep=args.second_dep,
                              deadline_s=args.deadline_s, probe_rate=args.probe_rate, dp_timeout_s=args.dp_timeout_s,
                              log_dir=args.log_dir)
    except ValueError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    if args.soak_min > 0:
        result = rack.run_soak(cfg, rack.SoakConfig(duration_s=args.soak_min * 60, every_s=args.soak_every_s,
                                                    streams=args.soak_streams))
        print(rack.soak_table(result))
        save(result, args.out)
        return 0
    result = rack.run(cfg)
    print(rack.table(result))
    save(result, args.out)
    return 0
