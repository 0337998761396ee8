"""`moemesh bench eplb`: a live DEP instance under a chosen routing skew.

A local mesh runs with one decode instance of N ranks; clients keep it busy through
the gateway. The benchmark reads the instance's expert loads as the balancer sees
them, asks the balancer for a rebalance (twice), and reports for the target model and
the MTP draft head: the balance ratio under the naive placement and after each
rebalance (measured on a fresh window, i.e. held out), the policy's compute time, the
bytes moved and the move's duration, and decode step times before, during and after.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import nats

from moemesh.tools.bench.env import environment, percentile
from moemesh.shared.eplb.placement import Placement
from moemesh.tools.launch.up import Mesh, UpConfig
from moemesh.shared.protocol.messages import (
    ExpertLoad, RebalanceReply, RebalanceRequest, StatsRequest, WorkerStats, decode,
)
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.dep_runtime import tensor_from
from moemesh.shared.service.nats_io import request


@dataclass(frozen=True)
class EplbBenchConfig:
    model: str = ""
    ranks: int = 2
    redundant: int = 1
    skew: str = "zipf:1.2"
    draft_skew: str = "hot:1,9:3.0"
    concurrency: int = 16
    max_tokens: int = 64
    warmup_s: float = 20.0
    window_s: float = 15.0
    rebalances: int = 2
    window_steps: int = 128
    seed: int = 0


class _Load:
    """Clients that keep the mesh busy until stopped."""

    def __init__(self, url: str, model: str, cfg: EplbBenchConfig):
        self.url, self.model, self.cfg = url, model, cfg
        self.stop = threading.Event()
        self.errors = 0
        self.done = 0
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(cfg.concurrency)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        rng = random.Random(self.cfg.seed * 1000 + i)
        words = "expert token rank balance router mesh decode prefill layer cache".split()
        with httpx.Client(timeout=300) as c:
            while not self.stop.is_set():
                prompt = " ".join(rng.choice(words) for _ in range(rng.randint(8, 48)))
                body = {"model": self.model, "prompt": prompt, "max_tokens": self.cfg.max_tokens, "temperature": 0.8,
                        "ignore_eos": True, "seed": rng.randrange(1 << 30)}
                try:
                    r = c.post(self.url + "/v1/completions", json=body)
                    self.done += r.status_code == 200
                    self.errors += r.status_code != 200
                except httpx.HTTPError:
                    self.errors += 1

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


async def latest_loads(nc, subjects: Subjects, instance: str, ranks: int, after: float):
    """The first complete set of rank loads published after `after` (unix time)."""
    sub = await nc.subscribe(subjects.eplb(instance, "load"))
    seen: dict[int, ExpertLoad] = {}
    try:
        while len(seen) < ranks or 0 not in seen:
            m = decode((await sub.next_msg(timeout=30)).data, ExpertLoad)
            if time.time() >= after:
                seen[m.rank] = m
    finally:
        await sub.unsubscribe()
    first = seen[0]
    loads = sum(tensor_from(m.counts, len(m.layer_ids)) for m in seen.values())
    return first, loads, tensor_from(first.phy2log, len(first.layer_ids))


def ratios(first: ExpertLoad, loads, phy2log, ranks: int) -> dict:
    p = Placement(phy2log, first.num_experts, ranks)
    rl = p.rank_loads(loads)
    out = {}
    for name, draft in (("target", False), ("draft", True)):
        rows = [i for i, lid in enumerate(first.layer_ids) if (lid >= first.num_target_layers) == draft]
        if rows:
            sel = rl[rows]
            out[name] = float(sel.mean(-1).sum() / sel.amax(-1).sum())
    return out


def _step_stats(steps: list[list[float]], lo: float, hi: float) -> dict:
    xs = [s[1] for s in steps if lo <= s[0] < hi]
    return {"n": len(xs), "p50_ms": percentile(xs, 50) * 1e3, "p99_ms": percentile(xs, 99) * 1e3,
            "max_ms": max(xs) * 1e3 if xs else float("nan")}


def split_loads(first: ExpertLoad, loads) -> dict:
    """The window's summed counts [layers, experts], target and draft layers apart: the
    recorded skew `moemesh plan --skew file:PATH` reads."""
    out: dict[str, list] = {"target": [], "draft": []}
    for i, lid in enumerate(first.layer_ids):
        out["draft" if lid >= first.num_target_layers else "target"].append(loads[i].tolist())
    return out


async def _measure(cfg: EplbBenchConfig, mesh: Mesh) -> dict:
    subjects = Subjects()
    inst = "decode-i0"
    nc = await nats.connect(mesh.nats_url)
    try:
        await asyncio.sleep(cfg.warmup_s)
        first, loads, phy = await latest_loads(nc, subjects, inst, cfg.ranks, time.time())
        phases = [{"phase": "naive", "placement_version": first.placement_version,
                   "ratio": ratios(first, loads, phy, cfg.ranks), "loads": split_loads(first, loads)}]
        moves = []
        for _ in range(cfg.rebalances):
            t0 = time.time()
            reply = await request(nc, subjects.eplb(inst, "rebalance"), RebalanceRequest(inst), RebalanceReply, 120)
            t1 = time.time()
            moves.append({"ok": reply.ok, "error": reply.error, "start": t0, "end": t1,
                          "policy_ms": reply.policy_seconds * 1e3, "move_s": reply.move_seconds,
                          "bytes_moved": reply.bytes_moved, "slots_changed": reply.slots_changed,
                          "ratio_in_window_before": reply.ratio_before,
                          "ratio_in_window_expected": reply.ratio_after_expected})
            await asyncio.sleep(cfg.window_s)  # a fresh window under the new placement: held out
            first, loads, phy = await latest_loads(nc, subjects, inst, cfg.ranks, time.time())
            phases.append({"phase": f"after rebalance {len(moves)}", "placement_version": first.placement_version,
                           "ratio": ratios(first, loads, phy, cfg.ranks)})
        stats = await request(nc, subjects.stats(f"{inst}-r0"), StatsRequest(detail=True), WorkerStats, 10)
    finally:
        await nc.close()
    steps = stats.recent_steps
    m0 = moves[0] if moves else {"start": float("inf"), "end": float("inf")}
    step_times = {"before": _step_stats(steps, 0, m0["start"]),
                  "during": _step_stats(steps, m0["start"], m0["end"]),
                  "after": _step_stats(steps, m0["end"], float("inf"))}
    return {"phases": phases, "moves": moves, "decode_step_times": step_times}


def run(cfg: EplbBenchConfig) -> dict:
    sets = [f"skew={cfg.skew}", f"draft_skew={cfg.draft_skew}", f"skew_seed={cfg.seed}",
            "load_publish_interval_s=0.5", f"load_window_steps={cfg.window_steps}", "num_kv_blocks=2048"]
    up = UpConfig(model=cfg.model, port=0, decode_dp=cfg.ranks, eplb_redundant=cfg.redundant, balancer=True,
                  service_args=tuple(sets), balancer_args=("auto=false", "move_timeout_s=60"))
    with Mesh(up) as mesh:
        load = _Load(mesh.url, Path(mesh.model).name, cfg)
        load.start()
        try:
            result = asyncio.run(_measure(cfg, mesh))
        finally:
            load.close()
    result.update({"bench": "eplb", "config": asdict(cfg) | {"model": cfg.model or "tiny"}, "env": environment(),
                   "requests_ok": load.done, "request_errors": load.errors})
    return result


def table(result: dict) -> str:
    lines = [f"{'placement':<22} {'version':>7} {'target ratio':>13} {'draft ratio':>12}"]
    for p in result["phases"]:
        r = p["ratio"]
        lines.append(f"{p['phase']:<22} {p['placement_version']:>7} {r.get('target', float('nan')):>13.3f} "
                     f"{r.get('draft', float('nan')):>12.3f}")
    lines.append("")
    lines.append(f"{'move':>4} {'ok':>3} {'policy ms':>10} {'move s':>8} {'MB moved':>9} {'slots':>6}")
    for i, m in enumerate(result["moves"], 1):
        lines.append(f"{i:>4} {'yes' if m['ok'] else 'no':>3} {m['policy_ms']:>10.2f} {m['move_s']:>8.3f} "
                     f"{m['bytes_moved'] / 1e6:>9.2f} {m['slots_changed']:>6}")
    lines.append("")
    lines.append(f"{'decode steps':<12} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for k, v in result["decode_step_times"].items():
        lines.append(f"{k:<12} {v['n']:>6} {v['p50_ms']:>8.2f} {v['p99_ms']:>8.2f} {v['max_ms']:>8.2f}")
    return "\n".join(lines)
