"""`moemesh bench grammar`."""

from __future__ import annotations

import argparse


def register(bsub) -> None:
    from moemesh.tools.cli.bench_io import ints

    g = bsub.add_parser("grammar", help="step time with structured-output requests in the batch")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the tiny model)")
    g.add_argument("--batch", type=int, default=64, help="sequences per step")
    g.add_argument("--constrained", type=ints, default=(0, 32), help="constrained requests per batch, one run each")
    g.add_argument("--steps", type=int, default=50, help="timed steps per point")
    g.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    g.add_argument("--real-forward", action="store_true", help="run the model's forward instead of the mock")
    g.add_argument("--vocab-size", type=int, default=0, help="the mock's vocabulary (default: the checkpoint's)")
    g.add_argument("--threads", type=int, default=1, help="torch threads")
    g.add_argument("--out", default="bench-results/grammar.json", help="JSON file for the results")
    g.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import grammar
    from moemesh.tools.cli.bench_io import save

    model = args.model
    if model is None:
        from moemesh.tools.launch.up import default_home, ensure_tiny_model

        model = str(ensure_tiny_model(default_home()))
    cfg = grammar.GrammarBenchConfig(model=model, batch=args.batch, constrained=args.constrained, steps=args.steps,
                                     warmup=args.warmup, mock=not args.real_forward, vocab_size=args.vocab_size,
                                     threads=args.threads)
    result = grammar.run(cfg)
    print(grammar.table(result))
    save(result, args.out)
    return 0
