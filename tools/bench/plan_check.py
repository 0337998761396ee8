"""`moemesh bench plan-check`: the step model (shared/plan) against runs on this machine.

Run: `bench forward` of the model at DEP1 and the expert kernel alone (the calibration)
-> the mock decode mesh at fixed step times (host overhead) -> for each width N in
--deps, a decode-only DEP-N mesh on the real model, balanced and then under a router
skew, --waves waves of --batch requests each, reading rank 0's step figures and the
instance's recorded load window, in --repeats interleaved rounds (each case takes its
median) -> the rank's speed in the mesh, fitted on the DEP1 run -> the latency of the
ranks' collectives at each DEP width above 1, between that many gloo processes computing
between them as long as the model says a rank in the mesh does (tools/bench/collectives.py)
-> the model's prediction of every run (shared/plan/check.py) beside the measurement. The
expert kernel is timed alone at the model's shapes so that the DEP1 forward can be split
into its data-parallel and expert parts.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, replace

from moemesh.shared.plan import check
from moemesh.shared.plan.calibrate import collective_latency, this_host
from moemesh.shared.plan.host import HOSTS, HostModel
from moemesh.tools.bench import collectives, decode_mock, forward, phases
from moemesh.tools.bench.env import environment
from moemesh.tools.bench.proc_cpu import machine_cpu_seconds, tree_cpu_seconds
from moemesh.tools.launch.up import default_home, ensure_tiny_model


@dataclass(frozen=True)
class PlanCheckConfig:
    model: str = ""
    deps: tuple[int, ...] = (1, 2, 4)
    batch: int = 16
    isl: int = 128
    osl: int = 64
    waves: int = 3
    repeats: int = 5
    skew: str = "zipf:1.2"
    mock_step_ms: tuple[float, ...] = (20.0, 5.0)
    mock_batches: tuple[int, ...] = (8, 64)
    mock_seconds: float = 5.0
    threads: int = 1
    seed: int = 0
    collective_calls: int = 200

    def __post_init__(self) -> None:
        if not self.deps or min(self.deps) < 1 or self.batch < max(self.deps) or min(self.waves, self.repeats) < 1:
            raise ValueError("--deps must be >= 1, --batch at least the widest instance, --waves and --repeats >= 1")
        if self.collective_calls < 1:
            raise ValueError("--collective-calls must be >= 1")


def time_experts(dims, threads: int = 1, repeats: int = 20) -> tuple[float, float]:
    """(seconds per expert slot that runs, seconds per pair) of the CPU expert kernel
    (shared/kernels/fused_moe.py) at the model's expert shapes, by least squares over a
    grid of slots hit and pairs per slot."""
    import numpy as np
    import torch

    from moemesh.shared.kernels.fused_moe import fused_moe

    torch.set_num_threads(threads)
    d, inter = dims.hidden, dims.expert_params // (3 * dims.hidden)
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(dims.num_experts, 2 * inter, d, generator=g) * 0.02
    w2 = torch.randn(dims.num_experts, d, inter, generator=g) * 0.02
    rows, times = [], []
    for slots in sorted({1, max(dims.num_experts // 4, 1), dims.num_experts}):
        for per_slot in (1, 4, 16):
            ids = torch.arange(slots).repeat_interleave(per_slot)[:, None]  # [P, 1]
            x = torch.randn(ids.shape[0], d, generator=g)
            w = torch.ones(ids.shape[0], 1)
            fused_moe(x, w13, w2, ids, w)
            t0 = time.perf_counter()
            for _ in range(repeats):
                fused_moe(x, w13, w2, ids, w)
            times.append((time.perf_counter() - t0) / repeats)
            rows.append([1.0, slots, slots * per_slot])
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    return max(float(coef[1]), 0.0), max(float(coef[2]), 0.0)


def _dep_case(cfg: PlanCheckConfig, model: str, dep: int, label: str, skew: str) -> tuple[check.Case, dict]:
    pcfg = phases.PhaseBenchConfig(model=model, isl=cfg.isl, osl=cfg.osl, batches=(cfg.batch,), dep=dep, skew=skew,
                                   threads=cfg.threads, seed=cfg.seed)
    with phases._mesh(pcfg, "decode", skew) as mesh:
        t0, m0, own0 = time.time(), machine_cpu_seconds(), tree_cpu_seconds({"mesh": os.getpid()})["mesh"]
        summ = phases._point(mesh, pcfg, cfg.isl, cfg.osl, cfg.batch, cfg.batch * cfg.waves)
        t1, m1, own1 = time.time(), machine_cpu_seconds(), tree_cpu_seconds({"mesh": os.getpid()})["mesh"]
        ratio, steps = asyncio.run(phases.instance_state(mesh, dep))
        window = asyncio.run(phases.instance_window(mesh, dep)) if dep > 1 else None
    st = phases._steps_between(steps, t0, t1, cfg.batch // dep)
    tpot = summ["tpot_ms"]["p50"]
    tps = cfg.batch / (tpot / 1e3) if tpot else 0.0
    name = f"DEP{dep} {label}"
    wait = st.get("rank_wait_ms_p50", 0.0) + st.get("loop_gap_ms_p50", 0.0)
    case = check.Case(name, "dep", dep, cfg.batch, tps, wait / 1e3,
                      forward_s=st.get("forward_ms_p50", 0.0) / 1e3, host_s=st.get("host_exposed_ms_p50", 0.0) / 1e3,
                      window=window)
    # The load average counts this mesh's own processes; what the rest of the machine took
    # during the run is the busy CPU less this process tree's (the mesh and its client).
    cpu = {"mesh_cores": (own1 - own0) / (t1 - t0), "other_cores": max(m1 - m0 - (own1 - own0), 0.0) / (t1 - t0)}
    return case, {"case": name, "skew": skew, "tokens_per_s": tps, "tpot_ms_p50": tpot, "balance_ratio": ratio,
                  "decode_steps": st, "cpu": cpu,
                  "errors": summ["num_errors"], "window": window}


def round_order(todo: list, repeats: int) -> list[tuple[int, object]]:
    """(round, case) in the order they run: every other round backwards, so that a drift in
    the machine's other load (it rises and falls over minutes) does not always land on the
    case that runs after another, as the skewed run of a width did when it always followed
    the balanced one."""
    return [(i, c) for i in range(repeats) for c in (todo if i % 2 == 0 else todo[::-1])]


def _median(cases: list[check.Case]) -> check.Case:
    """One case from repeated rounds: the median of each measured figure."""
    def med(key):
        xs = sorted(getattr(c, key) for c in cases)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    return replace(cases[0], measured_tps=med("measured_tps"), measured_wait_s=med("measured_wait_s"),
                   forward_s=med("forward_s"), host_s=med("host_s"))


def run(cfg: PlanCheckConfig) -> dict:
    from moemesh.tools.cli.cmd_plan import load_dims

    model = cfg.model or str(ensure_tiny_model(default_home()))
    dims, _ = load_dims(model)
    per_rank = sorted({max(cfg.batch // d, 1) for d in cfg.deps} | {1})
    fwd = forward.run(forward.ForwardBenchConfig(model=model, batch_sizes=tuple(per_rank),
                                                 context_len=cfg.isl + cfg.osl // 2, prefill_lens=(), steps=20,
                                                 warmup=4, num_threads=cfg.threads, seed=cfg.seed))
    slot_s, pair_s = time_experts(dims, cfg.threads)
    cases, runs = [], []
    for step_ms in cfg.mock_step_ms:
        mock = decode_mock.run(decode_mock.MockDecodeConfig(model=model, mock_step_ms=step_ms, isl=cfg.isl,
                                                            osl=cfg.osl, batches=cfg.mock_batches,
                                                            seconds=cfg.mock_seconds, threads=cfg.threads))
        for p in mock["runs"][0]["points"]:
            st = p["decode_steps"]
            cases.append(check.Case(f"mock {step_ms:g}ms b{p['batch']}", "mock", 1, p["batch"], p["tokens_per_s"],
                                    st.get("rank_wait_ms_p50", 0.0) / 1e3 if st else 0.0, step_ms=step_ms))
            runs.append({"case": cases[-1].name, "point": p})
    # Rounds of every DEP run, interleaved, so that a change in the machine's other load
    # lands on all of them; each case takes the median of its rounds.
    todo = [(dep, label, skew) for dep in cfg.deps for label, skew in (("balanced", ""), ("skewed", cfg.skew))
            if not (dep == 1 and skew)]  # one rank holds every expert: a skew changes nothing to wait for
    rounds: dict[str, list[check.Case]] = {}
    for i, (dep, label, skew) in round_order(todo, cfg.repeats):
        case, raw = _dep_case(cfg, model, dep, label, skew)
        rounds.setdefault(case.name, []).append(case)
        runs.append(raw | {"round": i, "loadavg_1m": os.getloadavg()[0]})
    cases += [_median(v) for v in rounds.values()]
    host = HOSTS["after-9"]
    base = replace(this_host(fwd, dims, cores=processors_left(runs)), slot_s=slot_s, pair_s=pair_s)
    speed = check.fit_speed(cases, dims, base, host, cfg.isl, cfg.osl)
    coll = _time_collectives(cfg, dims, fwd, slot_s, pair_s, speed, host)
    costs = replace(base, **collective_latency(coll))
    cmp = check.compare(cases, dims, costs, host, cfg.isl, cfg.osl)
    return {"bench": "plan-check", "config": asdict(cfg), "env": environment(), "forward": fwd["decode"],
            "collectives": coll, "comparison": cmp, "runs": runs}


def _time_collectives(cfg: PlanCheckConfig, dims, fwd: dict, slot_s: float, pair_s: float, speed: float,
                      host: HostModel) -> dict:
    """The collectives at each width, with what the model says a rank computes between
    them in the mesh: its forward at its batch (the calibration's, at the mesh's `speed`),
    the expert kernel for the pairs it receives, and its loop's host work (lockstep: none
    of it hidden) before the agreement. How long the ranks compute between two calls
    changes the calls' time here (two processes: 6.9, 7.4 and 8.2 ms of collectives a
    step with 1, 1.37 and 1.7 times the calibration's compute between them), so the
    compute is the mesh's, not the calibration's alone."""
    fwd_ms = {r["batch"]: r["forward_ms_p50"] for r in fwd["decode"]}
    tokens = {d: max(cfg.batch // d, 1) for d in cfg.deps}
    exp = {d: (slot_s * min(dims.num_experts // d, t * dims.top_k) + pair_s * t * dims.top_k) / speed
           for d, t in tokens.items()}
    hosts = {d: check.lockstep(host).host_s(t) for d, t in tokens.items()}
    return collectives.time_collectives(cfg.deps, tokens, dims.top_k, dims.hidden, cfg.collective_calls,
                                        dims.num_moe_layers, {d: fwd_ms[t] / 1e3 / speed for d, t in tokens.items()},
                                        exp, host_s_by_width=hosts)


def processors_left(runs: list[dict], cpu_count: int | None = None) -> float:
    """The processors other users left the mesh over its DEP runs: the machine's less the
    median of what the rest took during each (at least one)."""
    others = sorted(r["cpu"]["other_cores"] for r in runs if r.get("cpu"))
    n = cpu_count or os.cpu_count() or 1
    if not others:
        return float(n)
    return max(n - others[len(others) // 2], 1.0)


def table(result: dict) -> str:
    c = result["config"]
    head = (f"step model against this machine: {c['model'] or 'tiny'}, {c['batch']} requests, isl {c['isl']}, "
            f"osl {c['osl']}, skew {c['skew']}")
    spread = {}
    for r in result["runs"]:
        if "round" in r:
            cpu = r.get("cpu") or {}
            others = f", others {cpu['other_cores']:.2f} cores" if cpu else ""
            spread.setdefault(r["case"], []).append(f"{r['tokens_per_s']:.0f} (load {r['loadavg_1m']:.1f}{others})")
    rounds = [f"  {name}: {', '.join(v)}" for name, v in spread.items()]
    coll = [f"  {w} ranks: all-to-all {r['all_to_all_ms']:.2f} ms mean (p50 {r['all_to_all_ms_p50']:.2f}, p90 "
            f"{r['all_to_all_ms_p90']:.2f}), all-gather {r['all_gather_ms']:.2f} (p50 {r['all_gather_ms_p50']:.2f}, "
            f"p90 {r['all_gather_ms_p90']:.2f}), {r['calls']} steps; blocks: "
            + ", ".join(f"{a:.2f}/{g:.2f}" for a, g in r["blocks"])
            for w, r in result.get("collectives", {}).items()]
    return "\n".join([head, check.table(result["comparison"]), "tokens/s of each round:", *rounds,
                      "collectives timed after the DEP runs, at the compute the model gives a rank in the mesh:", *coll])
