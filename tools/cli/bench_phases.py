"""`moemesh bench decode` and `moemesh bench prefill`."""

from __future__ import annotations

import argparse
import sys


def register(bsub) -> None:
    from moemesh.tools.cli.bench_io import ints

    for name in ("decode", "prefill"):
        b = bsub.add_parser(name, help=("decode only, from dummy KV: end-to-end vs forward-only throughput"
                                        if name == "decode" else "prefill only (OSL 1): TTFT and tokens/s vs length"))
        b.add_argument("--model", default="", help="model directory (default: the tiny model)")
        if name == "decode":
            b.add_argument("--isl", type=int, default=512, help="context length of the dummy KV")
            b.add_argument("--osl", type=int, default=64, help="tokens per request")
            b.add_argument("--batch", type=ints, default=(8, 32, 64, 128, 256), help="concurrent requests")
            b.add_argument("--mock-step-ms", type=float, default=0.0,
                           help="host overhead on the mock engine with this step time instead of the model "
                                "(no forward-only run)")
            b.add_argument("--seconds", type=float, default=10.0, help="with --mock-step-ms: load per point")
            b.add_argument("--spec-tokens", type=int, default=0,
                           help="with --mock-step-ms: the mock drafts K tokens a step (0: no draft head)")
            b.add_argument("--accept-rate", type=float, default=0.7,
                           help="with --mock-step-ms: each mock draft's chance of being accepted")
        else:
            b.add_argument("--prompt-lens", type=ints, default=(128, 512, 2048), help="prompt lengths, comma-separated")
        b.add_argument("--requests", type=int, default=0,
                       help="requests per point (default: one wave of --batch for decode, 4 for prefill)")
        b.add_argument("--dep", type=int, default=1, help="ranks of the instance (reports its balance ratio)")
        b.add_argument("--skew", default="", help="routing skew, e.g. zipf:1.2")
        b.add_argument("--compare-skew", action="store_true", help="run balanced, then with --skew")
        b.add_argument("--threads", type=int, default=1, help="torch threads per worker")
        b.add_argument("--seed", type=int, default=0, help="seed of the prompts")
        b.add_argument("--out", default=f"bench-results/{name}.json", help="JSON file for the results")
        b.set_defaults(func=run, phase=name)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import phases
    from moemesh.tools.cli.bench_io import save

    if args.phase == "decode" and args.mock_step_ms:
        return _run_mock(args)
    if getattr(args, "spec_tokens", 0):
        print("moemesh: error: --spec-tokens and --accept-rate drive the mock's draft head: they need --mock-step-ms",
              file=sys.stderr)
        return 2
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


def _run_mock(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import decode_mock
    from moemesh.tools.cli.bench_io import save

    try:
        if args.compare_skew or args.requests:
            raise ValueError("--mock-step-ms runs one decode instance for --seconds per point: "
                             "--compare-skew and --requests do not apply")
        cfg = decode_mock.MockDecodeConfig(model=args.model, mock_step_ms=args.mock_step_ms, isl=args.isl,
                                           osl=args.osl, batches=args.batch, seconds=args.seconds,
                                           threads=args.threads, spec_tokens=args.spec_tokens,
                                           accept_rate=args.accept_rate, dep=args.dep, skew=args.skew)
    except ValueError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    result = decode_mock.run(cfg)
    print(decode_mock.table(result))
    save(result, args.out)
    return 0
