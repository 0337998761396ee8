"""`moemesh bench launches`."""

from __future__ import annotations

import argparse
import os
import sys


def register(bsub) -> None:
    from moemesh.tools.cli.bench_io import ints

    f = bsub.add_parser("launches", help="kernel launches and host syncs of one decode step and one prefill chunk")
    f.add_argument("--model", required=True, help="model directory")
    f.add_argument("--batch-sizes", type=ints, default=(1, 16), help="decode batch sizes, comma-separated")
    f.add_argument("--context-len", type=int, default=511,
                   help="cached tokens of each decode sequence (511: DeepSeek-V4's every compressor pools in the step)")
    f.add_argument("--prefill-len", type=int, default=128, help="tokens of the prefill chunk")
    f.add_argument("--kernels", choices=["triton", "torch"], default="triton",
                   help="the kernel path (on a CPU under the Triton interpreter) or the torch reference path")
    f.add_argument("--spec-tokens", type=int, default=0,
                   help="also count a steady MTP step verifying and drafting this many tokens (0: off)")
    f.add_argument("--device", default="cpu", help="cpu (kernels under the Triton interpreter) or cuda")
    f.add_argument("--top", type=int, default=12, help="how many of the most frequent ops to list")
    f.add_argument("--out", default="bench-results/launches.json", help="JSON file for the results")
    f.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"moemesh: error: --device {args.device}, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.kernels == "triton":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            print("moemesh: error: --kernels triton needs triton (pip install moemesh[kernels]); "
                  "or count the reference path with --kernels torch", file=sys.stderr)
            return 2
        if args.device == "cpu":  # before anything loads triton: it settles the mode then
            os.environ["TRITON_INTERPRET"] = "1"
    from moemesh.shared.checkpoint.loader import CheckpointError
    from moemesh.tools.bench import launches
    from moemesh.tools.cli.bench_io import save

    cfg = launches.LaunchesBenchConfig(model=args.model, batch_sizes=args.batch_sizes, context_len=args.context_len,
                                       prefill_len=args.prefill_len, kernels=args.kernels, top=args.top,
                                       spec_tokens=args.spec_tokens, device=args.device)
    try:
        result = launches.run(cfg)
    except (CheckpointError, ValueError) as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    print(launches.table(result))
    save(result, args.out)
    return 0
