"""How long the collectives of a DEP instance's ranks take on this machine, per width.

W gloo processes make, over and over, what W ranks make in a decode step: a MoE layer's
four all-to-alls (shared/model/expert_parallel.py: counts, tokens, slots, results back)
at the model's token sizes, and the per-step agreement (shared/engine/dp.py: an
all-gather of a few ints). Each call's wall time, after a warm-up, goes into a median
per kind over all processes' calls. The processes are pinned to nothing: they run on
the processors the ranks will, beside whatever else runs there, as the ranks do. On a
machine with fewer cores than processes, what a call costs is mostly the wake-ups
between them, which is the point of timing it rather than deriving it from bytes.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

_WARMUP = 10


def _worker(rank: int, width: int, init: str, calls: int, pairs: int, hidden: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=width, timeout=timedelta(seconds=60))
    per_peer = max(pairs // width, 1)
    counts, counts_in = torch.full((width,), per_peer, dtype=torch.long), torch.empty(width, dtype=torch.long)
    x, x_in = torch.randn(per_peer * width, hidden), torch.empty(per_peer * width, hidden)
    slots, slots_in = torch.zeros(per_peer * width, dtype=torch.long), torch.empty(per_peer * width, dtype=torch.long)
    mine = torch.tensor([1, 0, 0])
    gathered = [torch.empty_like(mine) for _ in range(width)]
    a2a, agree = [], []
    for i in range(_WARMUP + calls):
        for send, recv in ((counts, counts_in), (x, x_in), (slots, slots_in), (x, x_in)):
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send)
            if i >= _WARMUP:
                a2a.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dist.all_gather(gathered, mine)
        if i >= _WARMUP:
            agree.append(time.perf_counter() - t0)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"all_to_all": a2a, "all_gather": agree}, f)
    dist.destroy_process_group()


def time_width(width: int, pairs: int, hidden: int, calls: int = 300) -> dict:
    """Median wall time of each collective between `width` processes, each sending
    `pairs` token rows of `hidden` floats per layer (spread evenly over the peers).

    Returns {"all_to_all_ms_p50", "all_gather_ms_p50", "all_to_all_ms_p90",
    "all_gather_ms_p90", "calls", "wall_s"}."""
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moemesh-coll-") as d:
        init = f"file://{os.path.join(d, 'store')}"
        # fork: a fresh interpreter per process would import torch again, seconds on two cores
        mp.start_processes(_worker, args=(width, init, calls, pairs, hidden, d), nprocs=width, start_method="fork")
        a2a, agree = [], []
        for r in range(width):
            with open(os.path.join(d, f"{r}.json")) as f:
                got = json.load(f)
            a2a += got["all_to_all"]
            agree += got["all_gather"]

    def pct(xs, q):
        return statistics.quantiles(xs, n=10)[q] * 1e3 if len(xs) > 1 else xs[0] * 1e3

    return {"all_to_all_ms_p50": statistics.median(a2a) * 1e3, "all_gather_ms_p50": statistics.median(agree) * 1e3,
            "all_to_all_ms_p90": pct(a2a, 8), "all_gather_ms_p90": pct(agree, 8), "calls": calls,
            "wall_s": time.perf_counter() - t0}


def time_collectives(widths, tokens_by_width: dict[int, int], top_k: int, hidden: int, calls: int = 300) -> dict:
    """time_width() for each width above 1 (one rank makes no collectives), at that
    width's tokens per rank. Returns {width: time_width's figures}."""
    return {w: time_width(w, max(tokens_by_width[w], 1) * top_k, hidden, calls) for w in sorted(set(widths)) if w > 1}
