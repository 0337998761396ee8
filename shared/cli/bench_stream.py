"""`moemesh bench stream`."""

from __future__ import annotations

import argparse


def register(bsub) -> None:
    b = bsub.add_parser("stream", help="gateway + NATS + decode with the mock engine: tokens/s, gateway CPU/token")
    b.add_argument("--model", default="", help="model directory for config and tokenizer (default: tiny)")
    b.add_argument("--streams", type=int, default=256)
    b.add_argument("--seconds", type=float, default=20.0)
    b.add_argument("--osl", type=int, default=256)
    b.add_argument("--mock-step-ms", type=float, default=2.0)
    b.add_argument("--out", default="bench-results/stream.json")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.bench import stream
    from shared.cli.cmd_bench import save

    cfg = stream.StreamBenchConfig(model=args.model, streams=args.streams, seconds=args.seconds, osl=args.osl,
                                   mock_step_ms=args.mock_step_ms)
    result = stream.run(cfg)
    print(stream.table(result))
    save(result, args.out)
    return 0
