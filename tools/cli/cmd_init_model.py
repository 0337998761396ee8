"""`moemesh init-model DIR --preset NAME`: write a random-weight checkpoint, or with
`--train` a tiny one trained on CPU (tools/train/trainer.py)."""

from __future__ import annotations

import argparse
import sys

from moemesh.shared.checkpoint.presets import PRESETS
from moemesh.tools.train.config import DEFAULT_STEPS, TrainConfig, default_steps


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
    t = p.add_argument_group("training (--train)")
    t.add_argument("--train", action="store_true",
                   help="train the tiny model (tiny, tiny-v2, v4-tiny) on the Python standard library's sources, "
                        "on CPU, and save it in the same layout; a loss curve goes to DIR/train_loss.png "
                        "(needs transformers)")
    d = TrainConfig()
    t.add_argument("--train-steps", type=int, default=None,
                   help=f"optimizer steps (default {d.steps}; " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items())
                   + ")")
    t.add_argument("--train-batch", type=int, default=d.batch, help="sequences per step")
    t.add_argument("--train-seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    t.add_argument("--train-lr", type=float, default=d.lr, help="peak learning rate (warm-up, then cosine)")
    t.add_argument("--train-corpus-mb", type=float, default=d.corpus_mb, help="MiB of standard library text")
    t.add_argument("--train-bias-rate", type=float, default=d.bias_rate,
                   help="routers' correction-bias update per step (DeepSeek-V3's loss-free balancing; 0: off)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.shared.checkpoint.writer import init_model

    if args.train:
        return _train(args)
    try:
        out = init_model(args.dir, args.preset, seed=args.seed, dtype=args.dtype, num_layers=args.num_layers,
                         shard_size=args.shard_size_mb << 20, fused_experts=args.fused_experts,
                         layout=args.layout, quantize=args.quantize)
    except ValueError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from moemesh.tools.train.trainer import train

    if args.layout not in (None, "transformers") or args.quantize or args.fused_experts or args.num_layers:
        print("moemesh: error: --train writes the preset's shape in the transformers layout "
              "(drop --layout, --quantize, --fused-experts, --num-layers)", file=sys.stderr)
        return 2
    try:
        steps = args.train_steps if args.train_steps is not None else default_steps(args.preset)
        cfg = TrainConfig(steps=steps, batch=args.train_batch, seq_len=args.train_seq_len,
                          lr=args.train_lr, corpus_mb=args.train_corpus_mb, bias_rate=args.train_bias_rate,
                          seed=args.seed)
        result = train(args.dir, args.preset, cfg, init_seed=args.seed)
    except ValueError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    last = result.held_out[-1]
    draft = f", MTP draft {last[2]:.3f}" if result.mtp_trained else " (MTP head not trained)"
    print(f"trained {args.preset} for {cfg.steps} steps in {result.seconds:.0f}s: held-out loss {last[1]:.3f}"
          f"{draft}; wrote {result.out_dir} and {result.out_dir / 'train_loss.png'}")
    return 0
