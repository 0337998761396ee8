"""The step model set against measured runs on this host (`moemesh bench plan-check`).

Two kinds of run, each predicted from inputs measured apart from it:
- mock: `bench decode --mock-step-ms X` (one rank, a fixed device step). Predicted from
  the step time and the host preset measured before (host.py "after-9").
- DEP: `bench decode --dep N` on the real model, balanced and skewed, naive placement
  (the bench runs no balancer). Predicted from `bench forward` of the same model at DEP1
  (costs.Measured), the expert kernel timed on its own, the window of expert loads the
  run recorded (its skew), the cores the ranks share, and two figures fitted on one run
  (the first DEP>1 balanced one, which is then no evidence for the model): the cost of
  a collective call and a DEP rank's per-layer bookkeeping.

A case holds when predicted tokens/s and rank wait are both within `tolerance` of the
measured ones (rank wait: or within `wait_floor_s`, since a few tenths of a millisecond
of wait is below what this machine's scheduling noise lets one measure).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moemesh.shared.plan import skew as skews
from moemesh.shared.plan.balance import balance
from moemesh.shared.plan.costs import Costs, FixedStep, Measured
from moemesh.shared.plan.dims import ModelDims
from moemesh.shared.plan.host import HostModel
from moemesh.shared.plan.step import StepConfig, StepResult, run_step
from moemesh.shared.plan.workload import get_workload


@dataclass(frozen=True)
class Case:
    """One measured run. window: its recorded loads ({"target": [[...]]}) or None."""

    name: str
    kind: str  # "mock" or "dep"
    width: int
    batch: int  # concurrent requests over the instance
    measured_tps: float
    measured_wait_s: float
    step_ms: float = 0.0  # mock only
    window: dict | None = None


def predict(case: Case, dims: ModelDims, costs: Costs, host: HostModel, isl: int, osl: int,
            num_steps: int = 64, seed: int = 0) -> StepResult:
    """The step model's view of a run: per-rank batch = requests / width, the run's own
    recorded skew and the naive placement it ran with."""
    if case.kind == "mock":
        costs = FixedStep(case.step_ms / 1e3)
    rows = (case.window or {}).get("target")
    if rows and case.width > 1:
        sk = skews.from_loads(torch.tensor(rows, dtype=torch.float64), dims.num_moe_layers, "recorded")
    else:
        sk = skews.parse("uniform", dims.num_moe_layers, dims.num_experts, dims.top_k)
    bal = balance(sk, case.width, 0, eplb=False)
    cfg = StepConfig("decode", case.width, max(case.batch // case.width, 1), num_steps=num_steps, seed=seed)
    return run_step(cfg, dims, costs, bal, sk.popularity, get_workload(f"fixed:{isl}:{osl}"), host)


def rank0_wait_s(r: StepResult) -> float:
    """The bench reads rank 0's step figures; the model gives every rank's."""
    return r.extra["rank_wait_s_by_rank"][0]


def fit(case: Case, dims: ModelDims, costs: Measured, host: HostModel, isl: int, osl: int) -> Measured:
    """`costs` with the two figures a DEP>1 rank adds over DEP1 fitted on `case`: the
    cost of a collective call (from its rank-0 wait) and the per-layer EP bookkeeping
    (from its step time), each at least 0."""
    base = replace(costs, collective_s=0.0, ep_layer_s=0.0)
    r = predict(case, dims, base, host, isl, osl)
    calls = 4 * dims.num_moe_layers * costs.slowdown(case.width)
    fitted = replace(base, collective_s=max(case.measured_wait_s - rank0_wait_s(r), 0.0) / calls)
    r = predict(case, dims, fitted, host, isl, osl)
    measured_step = case.width * (case.batch // case.width) / case.measured_tps if case.measured_tps else r.step_s
    per_layer = dims.num_moe_layers * costs.slowdown(case.width)
    return replace(fitted, ep_layer_s=max(measured_step - r.step_s, 0.0) / per_layer)


def compare(cases: list[Case], dims: ModelDims, costs: Measured, host: HostModel, isl: int, osl: int,
            tolerance: float = 0.15, wait_floor_s: float = 0.5e-3) -> dict:
    """Fits the DEP figures on the first balanced DEP>1 case (fit()), predicts every case.

    Returns: {"collective_ms", "ep_layer_ms", "fitted_on", "rows": [...]} with, per case,
    measured and predicted tokens/s and rank wait, their errors, and whether it holds.
    """
    fit_on = next((c for c in cases if c.kind == "dep" and c.width > 1 and "balanced" in c.name), None)
    if fit_on is not None:
        costs = fit(fit_on, dims, costs, host, isl, osl)
    rows = []
    for c in cases:
        r = predict(c, dims, costs, host, isl, osl)
        tps = c.width * r.tokens_per_s_per_gpu
        wait = rank0_wait_s(r)
        tps_err = tps / c.measured_tps - 1 if c.measured_tps else None
        wait_err = wait / c.measured_wait_s - 1 if c.measured_wait_s > 0 else None
        wait_ok = abs(wait - c.measured_wait_s) <= max(tolerance * c.measured_wait_s, wait_floor_s)
        rows.append({"case": c.name, "kind": c.kind, "width": c.width, "batch": c.batch,
                     "measured_tps": c.measured_tps, "predicted_tps": tps, "tps_error": tps_err,
                     "measured_wait_ms": c.measured_wait_s * 1e3, "predicted_wait_ms": wait * 1e3,
                     "wait_error": wait_err, "predicted_ratio": r.ratio_before,
                     "predicted_terms_ms": {k: v * 1e3 for k, v in r.terms_s().items()},
                     "fitted": c is fit_on,
                     "holds": tps_err is not None and abs(tps_err) <= tolerance and wait_ok})
    return {"collective_ms": costs.collective_s * 1e3, "ep_layer_ms": costs.ep_layer_s * 1e3,
            "fitted_on": fit_on.name if fit_on else None, "rows": rows}


def table(result: dict) -> str:
    lines = [f"{'case':<22} {'tok/s meas':>10} {'pred':>8} {'err':>7} {'wait ms meas':>12} {'pred':>7} "
             f"{'err':>7} {'holds':>6}"]
    for r in result["rows"]:
        te = "-" if r["tps_error"] is None else f"{r['tps_error']:+.0%}"
        we = "-" if r["wait_error"] is None else f"{r['wait_error']:+.0%}"
        lines.append(f"{r['case']:<22} {r['measured_tps']:>10.0f} {r['predicted_tps']:>8.0f} {te:>7} "
                     f"{r['measured_wait_ms']:>12.2f} {r['predicted_wait_ms']:>7.2f} {we:>7} "
                     f"{('fit' if r['fitted'] else ('yes' if r['holds'] else 'NO')):>6}")
    lines.append(f"fitted on {result['fitted_on']}: collective call {result['collective_ms']:.3f} ms, "
                 f"EP bookkeeping {result['ep_layer_ms']:.3f} ms per MoE layer")
    return "\n".join(lines)
