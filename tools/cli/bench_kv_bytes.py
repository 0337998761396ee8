"""`moemesh bench kv-bytes`."""

from __future__ import annotations

import argparse


def register(bsub) -> None:
    b = bsub.add_parser("kv-bytes", help="KV cache bytes per token: DeepSeek-V4's hybrid cache against V3's")
    b.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="KV cache dtype")
    b.add_argument("--num-speculative-tokens", type=int, default=1, help="drafts the ring makes room for")
    b.add_argument("--out", default="bench-results/kv_bytes.json", help="JSON file for the results")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from moemesh.tools.bench import kv_bytes
    from moemesh.tools.cli.bench_io import save

    result = kv_bytes.run(getattr(torch, args.dtype), args.num_speculative_tokens)
    print(kv_bytes.table(result))
    save(result, args.out)
    return 0
