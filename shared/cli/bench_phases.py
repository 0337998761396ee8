"""`moemesh bench decode` and `moemesh bench prefill`."""

from __future__ import annotations

import argparse


def register(bsub) -> None:
    from shared.cli.cmd_bench import ints

    for name in ("decode", "prefill"):
        b = bsub.add_parser(name, help=("decode only, from dummy KV: end-to-end vs forward-only throughput"
                                        if name == "decode" else "prefill only (OSL 1): TTFT and tokens/s vs length"))
        b.add_argument("--model", default="", help="model directory (default: the tiny model)")
        if name == "decode":
            b.add_argument("--isl", type=int, default=512, help="context length of the dummy KV")
            b.add_argument("--osl", type=int, default=64)
            b.add_argument("--batch", type=ints, default=(8, 32, 64, 128, 256), help="concurrent requests")
        else:
            b.add_argument("--prompt-lens", type=ints, default=(128, 512, 2048))
        b.add_argument("--requests", type=int, default=0,
                       help="requests per point (default: one wave of --batch for decode, 4 for prefill)")
        b.add_argument("--dep", type=int, default=1, help="ranks of the instance (reports its balance ratio)")
        b.add_argument("--skew", default="", help="routing skew, e.g. zipf:1.2")
        b.add_argument("--compare-skew", action="store_true", help="run balanced, then with --skew")
        b.add_argument("--threads", type=int, default=1)
        b.add_argument("--seed", type=int, default=0)
        b.add_argument("--out", default=f"bench-results/{name}.json")
        b.set_defaults(func=run, phase=name)


def run(args: argparse.Namespace) -> int:
    from shared.bench import phases
    from shared.cli.cmd_bench import save

    if args.compare_skew and not args.skew:
        args.skew = "zipf:1.2"
    kw = {"isl": args.isl, "osl": args.osl, "batches": args.batch} if args.phase == "decode" else \
        {"prompt_lens": args.prompt_lens}
    cfg = phases.PhaseBenchConfig(model=args.model, requests_per_point=args.requests, dep=args.dep, skew=args.skew,
                                  compare_skew=args.compare_skew, threads=args.threads, seed=args.seed, **kw)
    if args.phase == "decode":
        result = phases.run_decode(cfg)
        print(phases.decode_table(result))
    else:
        result = phases.run_prefill(cfg)
        print(phases.prefill_table(result))
    save(result, args.out)
    return 0
