"""`moemesh bench idle`: what a mesh with nothing to do costs, process by process.

States, each measured over `seconds` after a few requests have gone through:
    idle              nothing in flight
    transfer pending  requests whose KV transfer never comes: the prefill worker drops
                      its sends (debug_kv_fault=drop), so each decode worker sits on a
                      posted UCX receive until transfer_timeout_s, longer than the window
Each at every mock step time given (0 included: a loop with no work must wait, however
short its steps). Goal: at most 2% of a core per process in every state.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx

from moemesh.tools.bench.env import environment
from moemesh.tools.bench.overhead import mesh_pids, role_of
from moemesh.tools.bench.proc_cpu import tree_cpu_seconds
from moemesh.tools.launch.up import Mesh, UpConfig

GOAL_CORE_SHARE = 0.02


@dataclass(frozen=True)
class IdleBenchConfig:
    model: str = ""
    mock_step_ms: tuple[float, ...] = (0.0, 20.0)
    seconds: float = 10.0
    settle_s: float = 2.0  # after the warm-up requests, before the window


def _mesh(cfg: IdleBenchConfig, step_ms: float, pending: bool) -> Mesh:
    sets = ("engine=mock", f"mock_step_ms={step_ms}")
    if pending:
        wait = cfg.seconds + cfg.settle_s + 30
        # drain_timeout_s: at the end, the stuck transfers must not hold the shutdown up.
        return Mesh(UpConfig(model=cfg.model, port=0, service_args=(*sets, "drain_timeout_s=1"),
                             prefill_args=("debug_kv_fault=drop",),
                             decode_args=(f"transfer_timeout_s={wait}", "on_transfer_failure=fail"),
                             gateway_args=(f"inactivity_timeout_s={wait + 30}",), balancer=False))
    return Mesh(UpConfig(model=cfg.model, port=0, service_args=sets, balancer=False))


def _requests(mesh: Mesh, n: int, wait: bool) -> None:
    body = {"model": mesh.model.rstrip("/").split("/")[-1], "prompt": "an idle mesh", "max_tokens": 8}
    if wait:
        with httpx.Client(timeout=60) as c:
            for _ in range(n):
                c.post(mesh.url + "/v1/completions", json=body).raise_for_status()
        return
    def fire(_):  # these never finish inside the window: send and leave them pending
        try:
            httpx.post(mesh.url + "/v1/completions", json=body, timeout=0.5)
        except httpx.TimeoutException:
            pass

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(fire, range(n)))


def measure(mesh: Mesh, seconds: float) -> dict[str, float]:
    """Share of one core each mesh process used over `seconds`, by role."""
    pids = mesh_pids(mesh)
    before, t0 = tree_cpu_seconds(pids), time.monotonic()
    time.sleep(seconds)
    after, dt = tree_cpu_seconds(pids), time.monotonic() - t0
    out: dict[str, float] = {}
    for name in pids:
        role = role_of(name)
        out[role] = out.get(role, 0.0) + (after[name] - before[name]) / dt
    return out


def run(cfg: IdleBenchConfig) -> dict:
    rows = []
    for step in cfg.mock_step_ms:
        for state, pending in (("idle", False), ("transfer pending", True)):
            with _mesh(cfg, step, pending) as mesh:
                _requests(mesh, 4, wait=not pending)
                time.sleep(cfg.settle_s)
                share = measure(mesh, cfg.seconds)
            rows.append({"mock_step_ms": step, "state": state, "core_share": share,
                         "max_core_share": max(share.values()), "met": max(share.values()) <= GOAL_CORE_SHARE})
    return {"bench": "idle", "config": asdict(cfg), "env": environment(), "goal_core_share": GOAL_CORE_SHARE,
            "points": rows}


def table(r: dict) -> str:
    roles = sorted({k for p in r["points"] for k in p["core_share"]})
    lines = [f"{'step ms':>7} {'state':<17}" + "".join(f"{x:>10}" for x in roles) + "   goal (<= "
             f"{r['goal_core_share']:.0%} of a core each)"]
    for p in r["points"]:
        lines.append(f"{p['mock_step_ms']:>7g} {p['state']:<17}"
                     + "".join(f"{p['core_share'].get(x, 0):>10.2%}" for x in roles)
                     + ("   met" if p["met"] else "   MISSED"))
    return "\n".join(lines)
