"""`moemesh bench ...`: benchmarks that print a table and save JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    f = bsub.add_parser("forward", help="forward-only decode and prefill step times")
    f.add_argument("--model", required=True)
    f.add_argument("--batch-sizes", type=_ints, default=(1, 8, 32, 64, 128, 256))
    f.add_argument("--context-len", type=int, default=512)
    f.add_argument("--prefill-lens", type=_ints, default=(128, 512, 2048))
    f.add_argument("--steps", type=int, default=10)
    f.add_argument("--warmup", type=int, default=3)
    f.add_argument("--dtype", default="float32")
    f.add_argument("--device", default="cpu")
    f.add_argument("--threads", type=int, default=None)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--out", default="bench-results/forward.json")
    f.set_defaults(func=run_forward)

    k = bsub.add_parser("kv-transfer", help="UCX KV transfer throughput vs memory-copy bandwidth")
    k.add_argument("--sizes", type=_ints, default=None, help="bytes, comma separated")
    k.add_argument("--iters", type=int, default=20)
    k.add_argument("--repeats", type=int, default=3)
    k.add_argument("--nats-url", default="")
    k.add_argument("--ucx-tls", default="")
    k.add_argument("--out", default="bench-results/kv_transfer.json")
    k.set_defaults(func=run_kv)


def _save(result: dict, out: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {path}", file=sys.stderr)


def run_forward(args: argparse.Namespace) -> int:
    from shared.bench import forward
    from shared.checkpoint.loader import CheckpointError

    cfg = forward.ForwardBenchConfig(
        model=args.model, batch_sizes=args.batch_sizes, context_len=args.context_len,
        prefill_lens=args.prefill_lens, steps=args.steps, warmup=args.warmup, dtype=args.dtype,
        device=args.device, num_threads=args.threads, seed=args.seed)
    try:
        result = forward.run(cfg)
    except (CheckpointError, ValueError) as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    print(forward.table(result))
    _save(result, args.out)
    return 0


def run_kv(args: argparse.Namespace) -> int:
    from shared.bench import kv_transfer

    kw = {"sizes": args.sizes} if args.sizes else {}
    cfg = kv_transfer.KVBenchConfig(iters=args.iters, repeats=args.repeats, nats_url=args.nats_url,
                                    tls=args.ucx_tls, **kw)
    result = kv_transfer.run(cfg)
    print(kv_transfer.table(result))
    _save(result, args.out)
    return 0
