"""`moemesh eplb place|score|compare`: expert placement from recorded loads.

File formats are in docs/eplb.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The grid's default skews, kept here so that --help does not import torch.
SKEWS = ("zipf:0.5", "zipf:0.69", "zipf:0.9", "zipf:1.2", "hot:1:0.1", "hot:4:0.4", "hot:8:0.5")


def register(sub) -> None:
    p = sub.add_parser("eplb", help="expert-parallel load balancing: build and score expert placements")
    esub = p.add_subparsers(dest="eplb", required=True)

    pl = esub.add_parser("place", help="build a placement from per-layer expert loads")
    pl.add_argument("--loads", required=True, help="loads JSON: {\"loads\": [[tokens per expert] per layer]}")
    pl.add_argument("--ranks", type=int, required=True, help="expert-parallel ranks")
    pl.add_argument("--redundant", type=int, default=0, help="redundant slots per rank")
    pl.add_argument("--out", required=True, help="placement JSON to write")
    pl.add_argument("--algorithm", default="ours",
                    choices=["ours", "ours-hierarchical", "deepseek-global", "deepseek-hierarchical"],
                    help="placement policy: ours or DeepSeek's reference; *-hierarchical keep expert groups "
                         "within nodes")
    pl.add_argument("--nodes", type=int, default=4, help="nodes (NVLink domains), for *-hierarchical")
    pl.add_argument("--groups", type=int, default=8, help="expert groups, for *-hierarchical")
    pl.add_argument("--current", default=None,
                    help="running placement JSON: ours starts from it, and the result is aligned to it")
    pl.add_argument("--threads", type=int, default=1, help="torch CPU threads (the balancer uses 1)")
    pl.set_defaults(func=run_place)

    sc = esub.add_parser("score", help="balance ratios of a placement under recorded loads")
    sc.add_argument("--placement", required=True, help="placement JSON file (from eplb place)")
    sc.add_argument("--loads", required=True, help="per-expert loads JSON file")
    sc.set_defaults(func=run_score)

    cp = esub.add_parser("compare", help="held-out comparison table: naive, DeepSeek EPLB, ours")
    cp.add_argument("--out", default=None, help="JSON file for the results (default bench-results/eplb_policy.json)")
    cp.add_argument("--pairs", type=int, default=5, help="target/draft load pairs to compare")
    cp.add_argument("--grid", action="store_true",
                    help="instead: ours vs DeepSeek held out on 252 scenarios (7 skews x E 64/128/256 x R 4-32 "
                         "x K 0-2), and ours' time on 43 x 256 x 32; --out defaults to bench-results/eplb_grid.json")
    cp.add_argument("--layers", type=int, default=8, help="layers per grid scenario")
    cp.add_argument("--skews", default=",".join(SKEWS), help="grid skews, comma-separated (zipf:A, hot:N:SHARE)")
    cp.add_argument("--experts", default="64,128,256", help="grid expert counts, comma-separated")
    cp.add_argument("--seed", type=int, default=1, help="grid workload seed (the documented grid is seed 1)")
    cp.set_defaults(func=run_compare)


def run_place(args: argparse.Namespace) -> int:
    import torch

    from moemesh.shared.eplb.align import align, moves_per_layer
    from moemesh.shared.eplb.placement import Placement, load_loads
    from moemesh.shared.eplb.policies import get_policy, timed_place

    torch.set_num_threads(args.threads)
    try:
        loads = load_loads(args.loads)
        current = Placement.from_json(json.loads(Path(args.current).read_text())) if args.current else None
        policy = get_policy(args.algorithm, num_nodes=args.nodes, num_groups=args.groups)
        placement, ms = timed_place(policy, loads, args.ranks, args.redundant, current)
        extra = {"algorithm": policy.name, "compute_ms": round(ms, 3),
                 "in_window_ratio": placement.instance_ratio(loads)}
        if current is not None:
            nodes = args.nodes if args.algorithm.endswith("-hierarchical") else 1
            placement = align(current, placement, num_nodes=nodes)
            moves = moves_per_layer(current, placement)
            extra.update(moves_per_layer=moves.tolist(), total_moves=int(moves.sum()))
    except (ValueError, KeyError, OSError) as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(placement.to_json(**extra)) + "\n")
    moved = f", {extra['total_moves']} slot moves" if current is not None else ""
    print(f"{policy.name}: {placement.num_layers} layers, in-window ratio {extra['in_window_ratio']:.4f}, "
          f"{ms:.1f} ms{moved} -> {args.out}")
    return 0


def run_score(args: argparse.Namespace) -> int:
    from moemesh.shared.eplb.placement import Placement, instance_ratio, layer_ratios, load_loads

    try:
        placement = Placement.from_json(json.loads(Path(args.placement).read_text()))
        loads = load_loads(args.loads)
        ranks = placement.rank_loads(loads)  # [L, R]
    except (ValueError, KeyError, OSError) as e:  # JSONDecodeError is a ValueError
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"instance_ratio": instance_ratio(ranks), "layer_ratios": layer_ratios(ranks).tolist(),
                      "mean_rank_load": ranks.mean(1).tolist(), "max_rank_load": ranks.amax(1).tolist()}))
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from moemesh.shared.eplb import compare

    if args.grid:
        return _run_grid(args)
    return compare.main(["--out", args.out or "bench-results/eplb_policy.json", "--pairs", str(args.pairs)])


def _run_grid(args: argparse.Namespace) -> int:
    from moemesh.shared.eplb import grid

    try:
        cfg = grid.GridConfig(skews=tuple(args.skews.split(",")), experts=tuple(int(e) for e in args.experts.split(",")),
                              num_layers=args.layers, seed=args.seed)
        result = grid.run_grid(cfg)
    except ValueError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    result["timing_ms"] = grid.timing()
    print(grid.table(result))
    path = Path(args.out or "bench-results/eplb_grid.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {path}", file=sys.stderr)
    return 0
