"""Ours against DeepSeek's EPLB on a grid of scenarios, held out: `moemesh eplb compare --grid`.

A scenario is a skew, an expert count E, a rank count R and K redundant slots per rank.
For each, `num_pairs` + 1 consecutive windows are sampled (workloads.py, seed `seed`,
which the policy was not tuned on); both policies build on window i and are scored on
window i + 1, and a scenario's score is the mean instance ratio over its pairs. The
default grid is 7 skews × 3 expert counts × 4 rank counts × 3 K = 252 scenarios.

Skew spellings: `zipf:A` (Zipf exponent A over shuffled experts) and `hot:N:SHARE`
(N hot experts carry SHARE of the routed tokens, the rest Zipf 0.25), as `moemesh plan`.

`timing()` is the other half of the check: ours on 43 layers × 256 experts × 32 ranks,
one thread, median over repeats.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from moemesh.shared.eplb import reference
from moemesh.shared.eplb.policy import build_placement
from moemesh.shared.eplb.workloads import HOT, ZIPF, Workload

SKEWS = ("zipf:0.5", "zipf:0.69", "zipf:0.9", "zipf:1.2", "hot:1:0.1", "hot:4:0.4", "hot:8:0.5")


@dataclass(frozen=True)
class GridConfig:
    skews: tuple[str, ...] = SKEWS
    experts: tuple[int, ...] = (64, 128, 256)
    ranks: tuple[int, ...] = (4, 8, 16, 32)
    redundant: tuple[int, ...] = (0, 1, 2)
    num_layers: int = 8
    num_pairs: int = 2
    seed: int = 1
    threads: int = 1


def workload(skew: str, num_experts: int, num_layers: int, seed: int) -> Workload:
    """The Workload a skew spelling stands for; ValueError on a bad one."""
    kind, _, arg = skew.partition(":")
    if kind == "zipf":
        return Workload(kind="zipf", num_layers=num_layers, num_experts=num_experts, zipf_exponent=float(arg),
                        seed=seed)
    if kind == "hot":
        n, _, share = arg.partition(":")
        return Workload(kind="hot", num_layers=num_layers, num_experts=num_experts, num_hot=int(n),
                        hot_share=float(share), zipf_exponent=0.25, seed=seed)
    raise ValueError(f"unknown skew {skew!r}; use zipf:A or hot:N:SHARE")


def run_grid(cfg: GridConfig = GridConfig()) -> dict:
    """{"config", "rows": one per scenario, "summary"}; a row's `gain` is ours - DeepSeek, held out."""
    torch.set_num_threads(cfg.threads)
    rows = []
    for skew in cfg.skews:
        for num_experts in cfg.experts:
            windows = workload(skew, num_experts, cfg.num_layers, cfg.seed).windows(cfg.num_pairs + 1).double()
            for num_ranks in cfg.ranks:
                for k in cfg.redundant:
                    rows.append(_scenario(windows, skew, num_experts, num_ranks, k))
    return {"config": asdict(cfg), "rows": rows, "summary": summary(rows)}


def _scenario(windows: torch.Tensor, skew: str, num_experts: int, num_ranks: int, k: int) -> dict:
    ours, theirs, ours_in, theirs_in, ms = [], [], [], [], []
    for i in range(windows.shape[0] - 1):
        start = time.perf_counter()
        p = build_placement(windows[i], num_ranks, k)
        ms.append((time.perf_counter() - start) * 1e3)
        q = reference.rebalance(windows[i], num_ranks, k)
        ours.append(p.instance_ratio(windows[i + 1]))
        theirs.append(q.instance_ratio(windows[i + 1]))
        ours_in.append(p.instance_ratio(windows[i]))
        theirs_in.append(q.instance_ratio(windows[i]))
    o, t = statistics.mean(ours), statistics.mean(theirs)
    return {"skew": skew, "experts": num_experts, "ranks": num_ranks, "redundant": k, "ours": o,
            "deepseek": t, "gain": o - t, "ours_in_window": statistics.mean(ours_in),
            "deepseek_in_window": statistics.mean(theirs_in), "ours_ms": statistics.median(ms)}


def summary(rows: list[dict]) -> dict:
    gains = [r["gain"] for r in rows]
    worst = min(rows, key=lambda r: r["gain"])
    return {"scenarios": len(rows), "min_gain": min(gains), "mean_gain": statistics.mean(gains),
            "behind": sum(g < 0 for g in gains), "worst": worst}


def timing(repeats: int = 5, threads: int = 1) -> dict:
    """Median ms of ours, from scratch, on 43 × 256 × 32 at K = 0, 1, 2 for ZIPF and HOT."""
    torch.set_num_threads(threads)
    out = {}
    for wl in (ZIPF, HOT):
        loads = replace(wl, seed=1).windows(1)[0].double()
        for k in (0, 1, 2):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                build_placement(loads, 32, k)
                times.append((time.perf_counter() - start) * 1e3)
            out[f"{wl.kind} K={k}"] = statistics.median(times)
    return out


def table(result: dict) -> str:
    s = result["summary"]
    w = s["worst"]
    lines = ["| skew | E | R | K | ours | deepseek | gain | ours in-window | ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['skew']} | {r['experts']} | {r['ranks']} | {r['redundant']} | {r['ours']:.4f} | "
                     f"{r['deepseek']:.4f} | {r['gain']:+.4f} | {r['ours_in_window']:.4f} | {r['ours_ms']:.1f} |")
    lines.append("")
    lines.append(f"{s['scenarios']} scenarios: gain (ours - deepseek, held out) min {s['min_gain']:+.4f}, "
                 f"mean {s['mean_gain']:+.4f}, {s['behind']} behind; worst {w['skew']} E={w['experts']} "
                 f"R={w['ranks']} K={w['redundant']} ({w['ours']:.4f} vs {w['deepseek']:.4f})")
    if "timing_ms" in result:
        lines.append("ours, 43 x 256 x 32, one thread, median ms: " +
                     ", ".join(f"{k} {v:.1f}" for k, v in result["timing_ms"].items()))
    return "\n".join(lines)
