"""`moemesh init-model DIR --preset NAME`: write a random-weight checkpoint."""

from __future__ import annotations

import argparse
import sys

from moemesh.shared.checkpoint.presets import PRESETS


def register(sub) -> None:
    p = sub.add_parser("init-model", help="write a seeded random-weight checkpoint, laid out as users download them")
    p.add_argument("dir", help="folder to write the checkpoint into (created if missing)")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS),
                   help="model shape: a tiny test model, or a published DeepSeek V3/V4 configuration")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights (the same seed writes the same checkpoint)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weight dtype (default: the preset's)")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--shard-size-mb", type=int, default=2048, help="largest safetensors shard, in MiB")
    p.add_argument("--fused-experts", action="store_true",
                   help="write experts fused, as transformers 5 holds them in memory (the hf layout)")
    p.add_argument("--layout", choices=["transformers", "hf", "upstream"], default=None,
                   help="tensor names: as transformers' save_pretrained writes them (transformers: the default "
                        "where transformers is installed, else hf), transformers' in-memory names for V4 and the "
                        "Hub's for V2/V3 (hf), or DeepSeek-V4's release (upstream: the default with --quantize)")
    p.add_argument("--quantize", action="store_true",
                   help="DeepSeek-V4, upstream layout: FP8 block-scaled weights and FP4 experts, as released")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.shared.checkpoint.writer import init_model

    try:
        out = init_model(args.dir, args.preset, seed=args.seed, dtype=args.dtype, num_layers=args.num_layers,
                         shard_size=args.shard_size_mb << 20, fused_experts=args.fused_experts,
                         layout=args.layout, quantize=args.quantize)
    except ValueError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0
