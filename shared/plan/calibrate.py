"""This host as a machine for the step model, from results this mesh's benchmarks wrote.

- forward times: `moemesh bench forward --model DIR` (its JSON: decode rows of batch and
  forward_ms_p50, prefill rows of prompt_len and forward_ms_p50);
- collective latency per width: gloo all-to-alls and all-gathers between that many
  processes, timed by `moemesh bench plan-check` after its DEP runs;
- host time per step: `moemesh bench decode --mock-step-ms X` (decode_steps of each point:
  host_ms_p50 and host_exposed_ms_p50), or `bench decode`'s own decode_steps;
- all of a rank's figures at once: a `bench plan-check` result (from_plan_check): its
  forward, its collectives and the figures it fitted on this mesh's DEP runs.
All are parsed here from already-loaded JSON; reading the files is the caller's.
"""

from __future__ import annotations

from dataclasses import replace

from moemesh.shared.plan.costs import Measured
from moemesh.shared.plan.dims import ModelDims
from moemesh.shared.plan.host import HostModel


def this_host(forward: dict, dims: ModelDims, *, cores: float = 0.0, collectives: dict | None = None,
              copy_bw: float = 5e9) -> Measured:
    """Measured costs from a `bench forward` result, and the collectives' latency per
    width from a `time_collectives` result (tools/bench/collectives.py:
    {width: {"all_to_all_ms", "all_gather_ms"}} (means), widths as ints or strings)."""
    if forward.get("bench") != "forward":
        raise ValueError("not a `bench forward` result (its 'bench' is not 'forward')")
    dec = sorted(forward.get("decode", []), key=lambda r: r["batch"])
    pre = sorted(forward.get("prefill", []), key=lambda r: r["prompt_len"])
    if not dec:
        raise ValueError("the `bench forward` result has no decode rows")
    return Measured(dims, tuple(float(r["batch"]) for r in dec), tuple(r["forward_ms_p50"] / 1e3 for r in dec),
                    tuple(float(r["prompt_len"]) for r in pre), tuple(r["forward_ms_p50"] / 1e3 for r in pre),
                    cores=cores, copy_bw=copy_bw, **collective_latency(collectives or {}))


def from_plan_check(result: dict, dims: ModelDims) -> Measured:
    """Measured costs from a `bench plan-check` result of the same model: the forward it
    calibrated, the collectives it timed per width, the expert kernel it timed, the
    processors it found left, and the two figures it fitted on the mesh's DEP runs (a
    rank's speed in the mesh, and its time per MoE layer beyond the kernel and the
    collectives). Widths beyond its widest are extrapolated (costs.by_width)."""
    if result.get("bench") != "plan-check":
        raise ValueError("not a `bench plan-check` result (its 'bench' is not 'plan-check')")
    try:
        f = result["comparison"]["fitted"]
        costs = this_host({"bench": "forward", "decode": result["forward"]}, dims, cores=f["cores"],
                          collectives=result.get("collectives") or {})
        return replace(costs, speed=f["speed"], ep_layer_s=f["ep_layer_ms"] / 1e3, slot_s=f["slot_us"] / 1e6,
                       pair_s=f["pair_us"] / 1e6)
    except (KeyError, TypeError) as e:
        raise ValueError(f"the `bench plan-check` result lacks {e}") from None


def collective_latency(collectives: dict) -> dict:
    """Measured's collective_s_by_width and agree_s_by_width from a `time_collectives` result."""
    rows = {int(w): r for w, r in collectives.items()}
    return {"collective_s_by_width": {w: r["all_to_all_ms"] / 1e3 for w, r in rows.items()},
            "agree_s_by_width": {w: r["all_gather_ms"] / 1e3 for w, r in rows.items()}}


def host_from_decode(result: dict, name: str = "measured") -> HostModel:
    """A host model from a `bench decode` result: the median over its points of host time
    per step, and the share of it hidden behind the forward (1 - exposed / host)."""
    host, exposed = [], []
    for run in result.get("runs", []):
        for p in run.get("points", []):
            st = p.get("decode_steps") or {}
            if st.get("host_ms_p50") is not None:
                host.append(st["host_ms_p50"])
                exposed.append(st.get("host_exposed_ms_p50", st["host_ms_p50"]))
    if not host:
        raise ValueError("the `bench decode` result has no decode step figures")
    h = sorted(host)[len(host) // 2]
    e = sorted(exposed)[len(exposed) // 2]
    hidden = min(max(1 - e / h, 0.0), 1.0) if h > 0 else 0.0
    return HostModel(name, fixed_s=h / 1e3, hidden_share=hidden)
