"""The serving overhead: what serving costs on top of the model's forward.

    serving_overhead = 1 - e2e_tokens_per_s / forward_only_tokens_per_s   (same batch B)

e2e comes from `moemesh bench decode` (through gateway, NATS and SSE, from a dummy KV);
forward-only from `moemesh bench forward` (the engine's forward alone), which bench decode
runs itself unless a separate forward result is given.

Where it goes: at the end-to-end rate, B tokens take t_e2e = B / e2e; the forward alone
takes t_fwd = B / forward_only, so overhead = (t_e2e - t_fwd) / t_e2e. The decode worker's
median step (bench decode's `decode_steps`) splits that difference:
    host           CPU time around the forward, with the serving loop's gap between steps
    rank_wait      collectives and waiting for the slowest rank (DEP)
    forward_drift  the served forward's median minus the bench's (contention, context length)
    rest           everything outside the engine step: request turnover, TTFT, steps run
                   below batch B while requests arrive and leave
Each part is in points of end-to-end time, so the four add up to the overhead. Medians do
not add exactly, so `rest` also absorbs that slack.
"""

from __future__ import annotations

MIN_BATCH, MAX_BATCH = 8, 256
PARTS = ("host", "rank_wait", "forward_drift", "rest")


class OverheadInputError(ValueError):
    """The file is not the bench result it was given as."""


def _forward_by_batch(forward_result: dict) -> dict[int, dict]:
    if forward_result.get("bench") != "forward" or not isinstance(forward_result.get("decode"), list):
        raise OverheadInputError("not a `moemesh bench forward` result (needs bench: forward and decode[])")
    return {int(r["batch"]): r for r in forward_result["decode"] if r.get("forward_tokens_per_s")}


def split(batch: int, e2e: float, forward_only: float, steps: dict | None) -> dict:
    """The overhead of one point and its parts (fractions of end-to-end time).

    Args:
        batch: concurrent requests B.
        e2e, forward_only: tokens/s.
        steps: bench decode's `decode_steps` medians (ms); empty or None leaves it unsplit.
    """
    overhead = 1 - e2e / forward_only
    t_e2e, t_fwd = 1e3 * batch / e2e, 1e3 * batch / forward_only  # ms per B tokens
    out = {"serving_overhead": overhead, "t_e2e_ms": t_e2e, "t_forward_ms": t_fwd, "parts": None,
           "loop_gap": None}
    if steps and all(isinstance(steps.get(k), (int, float)) for k in
                     ("forward_ms_p50", "host_ms_p50", "rank_wait_ms_p50")):
        host = steps.get("host_exposed_ms_p50", steps["host_ms_p50"])  # what the steps waited for
        parts = {"host": host / t_e2e, "rank_wait": steps["rank_wait_ms_p50"] / t_e2e,
                 "forward_drift": (steps["forward_ms_p50"] - t_fwd) / t_e2e}
        parts["rest"] = overhead - sum(parts.values())
        out["parts"] = parts
        if isinstance(steps.get("loop_gap_ms_p50"), (int, float)):
            out["loop_gap"] = steps["loop_gap_ms_p50"] / t_e2e  # already inside host
    return out


def analyse(decode_result: dict, forward_result: dict | None = None, min_batch: int = MIN_BATCH,
            max_batch: int = MAX_BATCH) -> dict:
    """Overhead per run and batch, and a headline over the batches in [min_batch, max_batch].

    Args:
        decode_result: a `moemesh bench decode` result.
        forward_result: a `moemesh bench forward` result to use instead of the decode
            result's own forward-only figures; batches it lacks are left out.
    Raises:
        OverheadInputError: a result without the fields this reads.
    """
    if decode_result.get("bench") != "decode" or not isinstance(decode_result.get("runs"), list):
        raise OverheadInputError("not a `moemesh bench decode` result (needs bench: decode and runs[])")
    fwd = _forward_by_batch(forward_result) if forward_result is not None else None
    notes = []
    if fwd is not None:
        ctx = {r.get("context_len") for r in forward_result["decode"]}
        cfg = decode_result.get("config") or {}
        want = cfg.get("isl", 0) + cfg.get("osl", 0) // 2 if "isl" in cfg else None
        if want is not None and ctx != {want}:
            notes.append(f"forward run's context {sorted(c for c in ctx if c is not None)} differs from the "
                         f"decode run's {want} (isl + osl/2): forward time grows with context")
    runs = []
    for run in decode_result["runs"]:
        points = []
        for p in run.get("points", []):
            b, e2e = p.get("batch"), p.get("e2e_tokens_per_s")
            fo = p.get("forward_only_tokens_per_s") if fwd is None else (fwd.get(b) or {}).get("forward_tokens_per_s")
            if not isinstance(b, int) or not e2e or not fo:
                notes.append(f"{run.get('label', 'run')}: batch {b} left out (no "
                             f"{'e2e' if not e2e else 'forward-only'} figure)")
                continue
            points.append({"batch": b, "e2e_tokens_per_s": e2e, "forward_only_tokens_per_s": fo,
                           "forward_source": "forward file" if fwd is not None else "bench decode",
                           "errors": p.get("errors"), **split(b, e2e, fo, p.get("decode_steps"))})
        points.sort(key=lambda q: q["batch"])
        runs.append({"label": run.get("label", "run"), "skew": run.get("skew", ""), "points": points,
                     "headline": headline(points, min_batch, max_batch)})
    return {"min_batch": min_batch, "max_batch": max_batch, "runs": runs, "notes": notes}


def headline(points: list[dict], min_batch: int = MIN_BATCH, max_batch: int = MAX_BATCH) -> dict | None:
    """Mean, min and max overhead over the batches in range, and its mean parts."""
    sel = [p for p in points if min_batch <= p["batch"] <= max_batch]
    if not sel:
        return None
    lo = min(sel, key=lambda p: p["serving_overhead"])
    hi = max(sel, key=lambda p: p["serving_overhead"])
    out = {"batches": [p["batch"] for p in sel],
           "mean": sum(p["serving_overhead"] for p in sel) / len(sel),
           "min": lo["serving_overhead"], "min_batch": lo["batch"],
           "max": hi["serving_overhead"], "max_batch": hi["batch"], "parts": None, "loop_gap": None}
    split_pts = [p for p in sel if p["parts"] is not None]
    if split_pts:
        out["parts"] = {k: sum(p["parts"][k] for p in split_pts) / len(split_pts) for k in PARTS}
        gaps = [p["loop_gap"] for p in split_pts if p["loop_gap"] is not None]
        out["loop_gap"] = sum(gaps) / len(gaps) if gaps else None
        out["parts_over_batches"] = [p["batch"] for p in split_pts]
    return out
