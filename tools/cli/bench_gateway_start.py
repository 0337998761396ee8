"""`moemesh bench gateway-start`."""

from __future__ import annotations

import argparse


def register(bsub) -> None:
    b = bsub.add_parser("gateway-start", help="gateway import time, time to /health and RSS, with a real nats-server")
    b.add_argument("--model", default="", help="model directory for config and tokenizer (default: tiny)")
    b.add_argument("--runs", type=int, default=5, help="fresh processes per figure (medians are reported)")
    b.add_argument("--out", default="bench-results/gateway_start.json", help="JSON file for the results")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import gateway_start
    from moemesh.tools.cli.bench_io import save

    result = gateway_start.run(gateway_start.GatewayStartConfig(model=args.model, runs=args.runs))
    print(gateway_start.table(result))
    save(result, args.out)
    return 0
