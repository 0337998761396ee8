"""`moemesh bench kv-reuse`."""

from __future__ import annotations

import argparse
import sys


def register(bsub) -> None:
    b = bsub.add_parser("kv-reuse", help="agentic multi-turn TTFT with prefix reuse vs without")
    b.add_argument("--model", default="", help="model directory (default: the tiny model)")
    b.add_argument("--sessions", type=int, default=4, help="conversations")
    b.add_argument("--turns", type=int, default=4, help="turns per conversation")
    b.add_argument("--context-tokens", type=int, default=0,
                   help="the first turn's context (default: 8192, or as much as the model's context leaves room for)")
    b.add_argument("--tool-tokens", type=int, default=512, help="tool output appended each turn")
    b.add_argument("--osl", type=int, default=64, help="tokens per answer")
    b.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    b.add_argument("--prefill-workers", type=int, default=1, help="prefill workers in the mesh")
    b.add_argument("--seed", type=int, default=0, help="seed of the conversations")
    b.add_argument("--out", default="bench-results/kv_reuse.json", help="JSON file for the results")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import kv_reuse
    from moemesh.tools.cli.bench_io import save

    cfg = kv_reuse.KVReuseBenchConfig(model=args.model, sessions=args.sessions, turns=args.turns,
                                      context_tokens=args.context_tokens, tool_tokens=args.tool_tokens,
                                      osl=args.osl, concurrency=args.concurrency,
                                      prefill_workers=args.prefill_workers, seed=args.seed)
    try:
        result = kv_reuse.run(cfg)
    except ValueError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    print(kv_reuse.table(result))
    save(result, args.out)
    return 0
