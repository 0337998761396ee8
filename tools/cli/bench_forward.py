"""`moemesh bench forward`."""

from __future__ import annotations

import argparse
import sys


def register(bsub) -> None:
    from moemesh.tools.cli.bench_io import ints

    f = bsub.add_parser("forward", help="forward-only decode and prefill step times")
    f.add_argument("--model", required=True, help="model directory")
    f.add_argument("--batch-sizes", type=ints, default=(1, 8, 32, 64, 128, 256),
                   help="decode batch sizes, comma-separated")
    f.add_argument("--context-len", type=int, default=512, help="context length of each decode sequence")
    f.add_argument("--prefill-lens", type=ints, default=(128, 512, 2048),
                   help="prompt lengths to prefill, comma-separated")
    f.add_argument("--steps", type=int, default=10, help="timed steps per point")
    f.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    f.add_argument("--dtype", default="float32", help="compute dtype")
    f.add_argument("--device", default="cpu", help="cpu or cuda")
    f.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1, as mesh workers run; 0 for torch's default)")
    f.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    f.add_argument("--decode-graphs", default="auto", choices=("auto", "on", "eager", "off"),
                   help="decode steps as CUDA graphs (auto: on a GPU); eager: the static path uncaptured")
    f.add_argument("--out", default="bench-results/forward.json", help="JSON file for the results")
    f.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import forward
    from moemesh.shared.checkpoint.loader import CheckpointError
    from moemesh.tools.cli.bench_io import save

    cfg = forward.ForwardBenchConfig(
        model=args.model, batch_sizes=args.batch_sizes, context_len=args.context_len,
        prefill_lens=args.prefill_lens, steps=args.steps, warmup=args.warmup, dtype=args.dtype,
        device=args.device, num_threads=args.threads or None, seed=args.seed,
        decode_graphs=args.decode_graphs)
    try:
        result = forward.run(cfg)
    except (CheckpointError, ValueError) as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    print(forward.table(result))
    save(result, args.out)
    return 0
