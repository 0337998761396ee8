"""The step model set against measured runs on this host (`moemesh bench plan-check`).

Two kinds of run:
- mock: `bench decode --mock-step-ms X` (one rank, a fixed device step), predicted from
  the step time and the host preset measured on another day (host.py "after-9"). Nothing
  is fitted to it.
- dep: `bench decode --dep N` on the real model (naive placement: the bench runs no
  balancer), balanced and under a router skew, predicted from:
  - `bench forward` of the same model at DEP1 and the expert kernel timed alone at the
    model's shapes (costs.Measured), which split a forward into its parts;
  - the latency of the ranks' collectives at each width, timed between that many gloo
    processes on this machine (an all-to-all, four per MoE layer; an all-gather, the
    agreement once per step), computing between them what the model gives a rank in
    the mesh: so after the DEP1 run has given the rank's speed (fit_speed);
  - the processors left to the ranks: the machine's less what other users took during
    the DEP runs (a lower bound on the step that binds only when ranks outnumber them);
  - the window of expert loads each run recorded (its skew);
  - the host preset, not overlapped on lockstep ranks (their loop does not overlap);
  - two figures fitted on two runs, which are then no evidence for the model:
    1. on the DEP1 run, how fast a rank computes in the mesh against the calibration's
       forward (`speed`): the step the model gives the DEP1 run meets the measured one;
    2. on the first balanced DEP>1 run, the time a DEP rank spends per MoE layer besides
       the expert kernel and the collectives' wait (routing, sorting, the combine, and
       whatever else of that run's step the model lacks).
  The other DEP runs (skewed, wider) are the evidence.

On this host a DEP rank spends most of its step waiting in collectives (gloo over
loopback: ~0.7 ms a call between two processes, ~2.8 ms between four, almost none of it
CPU). Most of that wait lands in rank wait, a little between its steps (the loop gap of
its step accounting); the model's wait is set against the two together.

A case holds when predicted tokens/s and wait are both within `tolerance` of the
measured ones (wait: or within `wait_floor_s`, as a few tenths of a millisecond of wait
are below what this machine's scheduling noise lets one measure).
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
    """One measured run.

    Args:
        name, kind ("mock" or "dep"), width, batch (requests in flight over the instance).
        measured_tps: batch / TPOT p50.
        measured_wait_s: rank 0's rank wait + loop gap (see the module docstring), p50s.
        forward_s, host_s: rank 0's step accounting, p50s (host: the exposed part).
        step_ms: the mock's step time.
        window: the recorded loads ({"target": [[count per expert] per layer]}) or None.
    """

    name: str
    kind: str
    width: int
    batch: int
    measured_tps: float
    measured_wait_s: float
    forward_s: float = 0.0
    host_s: float = 0.0
    step_ms: float = 0.0
    window: dict | None = None


@dataclass(frozen=True)
class Fitted:
    costs: Measured
    fitted_on: tuple[str, ...]


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


def lockstep(host: HostModel) -> HostModel:
    """Lockstep ranks' loops do not overlap the forward: all of their host time shows."""
    return replace(host, name="lockstep", hidden_share=0.0)


def host_for(case: Case, host: HostModel) -> HostModel:
    return lockstep(host) if case.width > 1 else host


def _measured_step(case: Case) -> float:
    return case.width * max(case.batch // case.width, 1) / case.measured_tps


def _solve(f, target: float, lo: float, hi: float, iters: int = 40) -> float:
    """x in [lo, hi] where the monotone f meets target, by bisection; the nearer end
    where it never does."""
    f_lo = f(lo) - target
    if f_lo == 0:
        return lo
    if (f(hi) - target) * f_lo > 0:
        return lo if abs(f_lo) <= abs(f(hi) - target) else hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (f(mid) - target) * f_lo > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _dep1(cases: list[Case]) -> Case | None:
    return next((c for c in cases if c.kind == "dep" and c.width == 1 and c.measured_tps), None)


def fit_speed(cases: list[Case], dims: ModelDims, costs: Measured, host: HostModel, isl: int, osl: int) -> float:
    """fit()'s first figure alone: how fast a rank computes in the mesh against the
    calibration (costs.speed where there is no DEP1 run). It needs no collectives (one
    rank makes none), so the bench can time them afterwards at the compute it implies."""
    dep1 = _dep1(cases)
    if dep1 is None:
        return costs.speed

    def dep1_step(speed):
        return predict(dep1, dims, replace(costs, speed=speed), host, isl, osl).step_s
    return _solve(dep1_step, _measured_step(dep1), 0.05, 20.0)


def fit(cases: list[Case], dims: ModelDims, costs: Measured, host: HostModel, isl: int, osl: int) -> Fitted:
    """The figures the module docstring lists, from the DEP1 run and the first balanced
    DEP>1 run (either may be missing: its figures then keep their values). Each is the
    value at which the model's step for its run meets the measured step."""
    names = []
    dep1 = _dep1(cases)
    if dep1 is not None:
        costs = replace(costs, speed=fit_speed(cases, dims, costs, host, isl, osl))
        names.append(dep1.name)
    wide = next((c for c in cases if c.kind == "dep" and c.width > 1 and "balanced" in c.name and c.measured_tps),
                None)
    if wide is not None:
        def wide_step(ep_layer_s):
            return predict(wide, dims, replace(costs, ep_layer_s=ep_layer_s), host_for(wide, host), isl, osl).step_s
        costs = replace(costs, ep_layer_s=_solve(wide_step, _measured_step(wide), 0.0, 0.1))
        names.append(wide.name)
    return Fitted(costs, tuple(names))


def compare(cases: list[Case], dims: ModelDims, costs: Measured, host: HostModel, isl: int, osl: int,
            tolerance: float = 0.15, wait_floor_s: float = 0.5e-3) -> dict:
    """Fits (fit()), then predicts every case. Returns {"fitted": figures, "fitted_on":
    names, "rows": per case measured and predicted tokens/s and wait, their errors,
    whether it was fitted on and whether it holds}."""
    f = fit(cases, dims, costs, host, isl, osl)
    rows = []
    for c in cases:
        r = predict(c, dims, f.costs, host_for(c, host), isl, osl)
        tps = c.width * r.tokens_per_s_per_gpu
        wait = rank0_wait_s(r)
        tps_err = tps / c.measured_tps - 1 if c.measured_tps else None
        wait_err = wait / c.measured_wait_s - 1 if c.measured_wait_s > 0 else None
        wait_ok = abs(wait - c.measured_wait_s) <= max(tolerance * c.measured_wait_s, wait_floor_s)
        rows.append({"case": c.name, "kind": c.kind, "width": c.width, "batch": c.batch,
                     "measured_tps": c.measured_tps, "predicted_tps": tps, "tps_error": tps_err,
                     "measured_wait_ms": c.measured_wait_s * 1e3, "predicted_wait_ms": wait * 1e3,
                     "wait_error": wait_err, "predicted_ratio": r.ratio_before,
                     "measured_forward_ms": c.forward_s * 1e3, "measured_host_ms": c.host_s * 1e3,
                     "predicted_terms_ms": {k: v * 1e3 for k, v in r.terms_s().items()},
                     "fitted": c.name in f.fitted_on,
                     "holds": tps_err is not None and abs(tps_err) <= tolerance and wait_ok})
    figures = {"speed": f.costs.speed, "ep_layer_ms": f.costs.ep_layer_s * 1e3, "cores": f.costs.cores,
               "all_to_all_ms": {w: v * 1e3 for w, v in sorted(f.costs.collective_s_by_width.items())},
               "agree_ms": {w: v * 1e3 for w, v in sorted(f.costs.agree_s_by_width.items())},
               "slot_us": f.costs.slot_s * 1e6, "pair_us": f.costs.pair_s * 1e6}
    return {"fitted": figures, "fitted_on": list(f.fitted_on), "rows": rows}


def table(result: dict) -> str:
    lines = [f"{'case':<22} {'tok/s meas':>10} {'pred':>8} {'err':>7} {'wait ms meas':>12} {'pred':>7} "
             f"{'err':>7} {'holds':>6}"]
    for r in result["rows"]:
        te = "-" if r["tps_error"] is None else f"{r['tps_error']:+.0%}"
        we = "-" if r["wait_error"] is None else f"{r['wait_error']:+.0%}"
        lines.append(f"{r['case']:<22} {r['measured_tps']:>10.0f} {r['predicted_tps']:>8.0f} {te:>7} "
                     f"{r['measured_wait_ms']:>12.2f} {r['predicted_wait_ms']:>7.2f} {we:>7} "
                     f"{('fit' if r['fitted'] else ('yes' if r['holds'] else 'NO')):>6}")
    f = result["fitted"]
    lines.append(f"fitted on {', '.join(result['fitted_on']) or 'nothing'}: ranks compute at {f['speed']:.2f} of the "
                 f"calibration's speed, {f['ep_layer_ms']:.3f} ms a MoE layer of DEP work beyond the expert "
                 f"kernel and the collectives")
    coll = ", ".join(f"{w} ranks {a:.2f}/{f['agree_ms'].get(w, 0.0):.2f}" for w, a in f["all_to_all_ms"].items())
    lines.append(f"measured: {f['cores']:.2f} processors left to the ranks; all-to-all/all-gather ms: "
                 f"{coll or 'none'}; expert kernel {f['slot_us']:.0f} us per slot + {f['pair_us']:.1f} us per pair")
    return "\n".join(lines)
