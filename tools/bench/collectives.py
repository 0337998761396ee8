"""How long the collectives of a DEP instance's ranks take on this machine, per width.

W gloo processes make, over and over, the collectives W ranks make in a decode step,
shaped like one: the per-step agreement (shared/engine/dp.py: an all-gather of a few
ints), then per MoE layer four all-to-alls (shared/model/expert_parallel.py: counts,
tokens, slots, results back) at the model's token sizes, with the rank's own compute
between them (a busy loop as long as the calibration's forward at that batch, spread
before the agreement and each layer's dispatch, and the expert kernel's time before
the combine). The processes are pinned to nothing: they run on the processors the
ranks will, beside whatever else runs there, as the ranks do.

Why the compute between calls: back to back, two processes on two cores stay awake and
a call takes 0.2 ms; with the compute between, one arrives first and sleeps, and a call
takes 0.5-0.7 ms, as inside the mesh. How long they compute matters too: the longer a
process ran before a call, the longer its peers slept in it, and the slower the call
(two processes here: 6.9, 7.4 and 8.2 ms of collectives a step at 1, 1.37 and 1.7 times
one compute; four: 26.2, 26.4 and 28.5). So the caller passes the compute a rank has in
the mesh, host work included, not an idealised one. A background load beside the
processes does not stand in for the mesh's other processes: it made four processes'
calls faster (26 to 21 ms a step), two processes' slower. Why the mean and not the median: a step waits
for the sum of its calls, and their times have a long tail (p50 0.8, mean 1.9 ms for
four processes back to back in one run here).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

_WARMUP = 10


def _spin(seconds: float) -> None:
    """Compute for `seconds` (holds the processor, as a rank's forward does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _worker(rank: int, width: int, init: str, calls: int, pairs: int, hidden: int, out_dir: str,
            layers: int, dense_s: float, expert_s: float, host_s: float) -> None:
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

    def timed(out: list, i: int, call, *args) -> None:
        t0 = time.perf_counter()
        call(*args)
        if i >= _WARMUP:
            out.append(time.perf_counter() - t0)

    for i in range(_WARMUP + calls):
        _spin(host_s + dense_s)  # the loop's host work, then the forward up to the agreement
        timed(agree, i, dist.all_gather, gathered, mine)
        for _ in range(layers):
            _spin(dense_s)
            for send, recv in ((counts, counts_in), (x, x_in), (slots, slots_in)):
                timed(a2a, i, dist.all_to_all_single, recv, send)
            _spin(expert_s)
            timed(a2a, i, dist.all_to_all_single, x_in, x)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"all_to_all": a2a, "all_gather": agree}, f)
    dist.destroy_process_group()


def time_width(width: int, pairs: int, hidden: int, calls: int = 300, layers: int = 2, forward_s: float = 0.0,
               expert_s: float = 0.0, host_s: float = 0.0) -> dict:
    """Wall time of each collective between `width` processes over `calls` steps, each
    process sending `pairs` token rows of `hidden` floats per layer (spread evenly over
    the peers), computing `forward_s` a step around them, `expert_s` before each
    combine and `host_s` before the agreement.

    Returns {"all_to_all_ms", "all_gather_ms" (means), "all_to_all_ms_p50",
    "all_gather_ms_p50", "all_to_all_ms_p90", "all_gather_ms_p90", "calls", "wall_s"}."""
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moemesh-coll-") as d:
        init = f"file://{os.path.join(d, 'store')}"
        # fork: a fresh interpreter per process would import torch again, seconds on two cores
        mp.start_processes(_worker, args=(width, init, calls, pairs, hidden, d, layers, forward_s / (layers + 1),
                                          expert_s, host_s), nprocs=width, start_method="fork")
        a2a, agree = [], []
        for r in range(width):
            with open(os.path.join(d, f"{r}.json")) as f:
                got = json.load(f)
            a2a += got["all_to_all"]
            agree += got["all_gather"]

    def pct(xs, q):
        return statistics.quantiles(xs, n=10)[q] * 1e3 if len(xs) > 1 else xs[0] * 1e3

    return {"all_to_all_ms": statistics.fmean(a2a) * 1e3, "all_gather_ms": statistics.fmean(agree) * 1e3,
            "all_to_all_ms_p50": statistics.median(a2a) * 1e3, "all_gather_ms_p50": statistics.median(agree) * 1e3,
            "all_to_all_ms_p90": pct(a2a, 8), "all_gather_ms_p90": pct(agree, 8), "calls": calls,
            "wall_s": time.perf_counter() - t0}


def time_collectives(widths, tokens_by_width: dict[int, int], top_k: int, hidden: int, calls: int = 300,
                     layers: int = 2, forward_s_by_width: dict[int, float] | None = None,
                     expert_s_by_width: dict[int, float] | None = None, blocks: int = 3,
                     host_s_by_width: dict[int, float] | None = None) -> dict:
    """time_width() for each width above 1 (one rank makes no collectives), at that
    width's tokens per rank and compute, in `blocks` blocks of `calls` steps, the widths
    taking turns; each figure is the median over its blocks. Two runs of one block a
    few seconds apart gave four processes 19.6 and 25.8 ms of collectives a step here:
    the machine's state, which the turns spread over, not the number of calls.

    Returns {width: time_width's figures, with "blocks": each block's all-to-all and
    all-gather means, and "calls" and "wall_s" summed}."""
    fwd, exp, host = forward_s_by_width or {}, expert_s_by_width or {}, host_s_by_width or {}
    runs: dict[int, list[dict]] = {}
    for _ in range(blocks):
        for w in sorted(set(widths)):
            if w > 1:
                runs.setdefault(w, []).append(time_width(w, max(tokens_by_width[w], 1) * top_k, hidden, calls, layers,
                                                         fwd.get(w, 0.0), exp.get(w, 0.0), host.get(w, 0.0)))
    out = {}
    for w, rs in runs.items():
        fig = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("calls", "wall_s")}
        out[w] = fig | {"calls": sum(r["calls"] for r in rs), "wall_s": sum(r["wall_s"] for r in rs),
                        "blocks": [[r["all_to_all_ms"], r["all_gather_ms"]] for r in rs]}
    return out
