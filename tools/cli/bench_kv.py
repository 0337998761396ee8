"""`moemesh bench kv-transfer`."""

from __future__ import annotations

import argparse


def register(bsub) -> None:
    from moemesh.tools.cli.bench_io import ints

    k = bsub.add_parser("kv-transfer", help="UCX KV transfer throughput vs the machine's copy bandwidth")
    k.add_argument("--sizes", type=ints, default=None, help="bytes, comma separated")
    k.add_argument("--context-lens", type=ints, default=(),
                   help="time one request's hand-off at these contexts, V4-Flash against V3 (instead of --sizes)")
    k.add_argument("--iters", type=int, default=20, help="transfers timed per point")
    k.add_argument("--repeats", type=int, default=3, help="repeats of each point (the best is kept)")
    k.add_argument("--nats-url", default="", help="use this NATS server (default: start one)")
    k.add_argument("--ucx-tls", default="", help="UCX transports to use (UCX_TLS; default: UCX's choice)")
    k.add_argument("--send-spin-us", type=float, default=None,
                   help="how long a send progresses UCX before sleeping on its event fd (default: the workers')")
    k.add_argument("--out", default="bench-results/kv_transfer.json", help="JSON file for the results")
    k.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.bench import kv_transfer
    from moemesh.tools.cli.bench_io import save

    kw = {"sizes": args.sizes} if args.sizes else {}
    if args.send_spin_us is not None:
        kw["send_spin_us"] = args.send_spin_us
    cfg = kv_transfer.KVBenchConfig(iters=args.iters, repeats=args.repeats, nats_url=args.nats_url,
                                    tls=args.ucx_tls, context_lens=args.context_lens, **kw)
    result = kv_transfer.run(cfg)
    print(kv_transfer.table(result))
    save(result, args.out)
    return 0
