"""Held-out comparison of placement algorithms: `python -m moemesh.shared.eplb.compare`.

For each workload, consecutive windows w_0 .. w_n are sampled; every algorithm builds
a placement from w_i and is scored on w_i itself (in-window, flattering) and on w_i+1
(held out, what an instance gets). Compute time is the median over builds on one
thread, as the balancer runs it. `run()` returns JSON-ready results and `table()`
formats them; `moemesh eplb compare` runs it. (`moemesh bench eplb` is the live-instance
benchmark, a different thing: real ranks, real moves.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from moemesh.shared.eplb.align import align, moves_per_layer
from moemesh.shared.eplb.placement import naive_placement
from moemesh.shared.eplb.policies import DeepSeekPolicy, OursHierarchicalPolicy, OursPolicy, timed_place
from moemesh.shared.eplb.workloads import HOT, ZIPF, Workload


@dataclass(frozen=True)
class CompareConfig:
    num_ranks: int = 32
    num_redundant: int = 1
    num_nodes: int = 4
    num_groups: int = 8
    num_pairs: int = 5
    seed: int = 0
    threads: int = 1
    workloads: tuple[Workload, ...] = field(default=(ZIPF, HOT))


def run(cfg: CompareConfig = CompareConfig()) -> dict:
    torch.set_num_threads(cfg.threads)
    policies = [DeepSeekPolicy(), DeepSeekPolicy(cfg.num_nodes, cfg.num_groups), OursPolicy(),
                OursHierarchicalPolicy(cfg.num_nodes, cfg.num_groups)]
    rows = []
    for workload in cfg.workloads:
        wl = replace(workload, seed=cfg.seed)
        windows = wl.windows(cfg.num_pairs + 1).double()  # [W, L, E]
        naive = naive_placement(wl.num_layers, wl.num_experts, cfg.num_ranks, cfg.num_redundant)
        rows.append(_row(wl, "naive", [naive] * cfg.num_pairs, windows, [0.0]))
        for policy in policies:
            built, times = [], []
            for i in range(cfg.num_pairs):
                placement, ms = timed_place(policy, windows[i], cfg.num_ranks, cfg.num_redundant)
                built.append(placement)
                times.append(ms)
            row = _row(wl, policy.name, built, windows, times)
            # Expert copies per layer when window i+1's placement replaces window i's.
            moved = [moves_per_layer(a, align(a, b, num_nodes=_nodes(policy))).double().mean().item()
                     for a, b in zip(built, built[1:])]
            row["moves_per_layer"] = statistics.mean(moved) if moved else None
            rows.append(row)
        rows.append(_incremental(wl, windows, cfg))
    return {"config": {**asdict(cfg), "workloads": [asdict(w) for w in cfg.workloads]}, "results": rows}


def _incremental(wl: Workload, windows: torch.Tensor, cfg: CompareConfig) -> dict:
    """Ours as the balancer runs it: each window's placement starts from the previous one."""
    policy = OursPolicy()
    built, times, moved = [], [], []
    for i in range(cfg.num_pairs):
        current = built[-1] if built else None
        placement, ms = timed_place(policy, windows[i], cfg.num_ranks, cfg.num_redundant, current)
        if current is not None:
            moved.append(moves_per_layer(current, placement).double().mean().item())
            times.append(ms)
        built.append(placement)
    row = _row(wl, "ours-incremental", built, windows, times or [float("nan")])
    row["moves_per_layer"] = statistics.mean(moved) if moved else None
    return row


def table(result: dict) -> str:
    head = ("| workload | algorithm | in-window | held-out | held-out min | compute ms | moves/layer |\n"
            "|---|---|---|---|---|---|---|")
    lines = [head]
    for r in result["results"]:
        moves = "" if r.get("moves_per_layer") is None else f"{r['moves_per_layer']:.1f}"
        lines.append(f"| {r['workload']} | {r['algorithm']} | {r['in_window']:.4f} | {r['held_out']:.4f} | "
                     f"{r['held_out_min']:.4f} | {r['compute_ms']:.1f} | {moves} |")
    return "\n".join(lines)


def _row(wl: Workload, name: str, built: list, windows: torch.Tensor, times: list[float]) -> dict:
    inside = [p.instance_ratio(windows[i]) for i, p in enumerate(built)]
    held = [p.instance_ratio(windows[i + 1]) for i, p in enumerate(built)]
    return {"workload": wl.kind, "algorithm": name, "in_window": statistics.mean(inside),
            "held_out": statistics.mean(held), "held_out_min": min(held), "compute_ms": statistics.median(times)}


def _nodes(policy) -> int:
    return getattr(policy, "num_nodes", 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moemesh.shared.eplb.compare", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--redundant", type=int, default=1)
    p.add_argument("--nodes", type=int, default=4, help="nodes for the hierarchical policies")
    p.add_argument("--groups", type=int, default=8, help="expert groups for the hierarchical policies")
    p.add_argument("--pairs", type=int, default=5, help="build/score window pairs per workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench-results/eplb_policy.json")
    args = p.parse_args(argv)
    cfg = CompareConfig(num_ranks=args.ranks, num_redundant=args.redundant, num_nodes=args.nodes,
                        num_groups=args.groups, num_pairs=args.pairs, seed=args.seed, threads=args.threads)
    result = run(cfg)
    print(table(result))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
