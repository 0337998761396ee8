"""`moemesh bench decode` and `moemesh bench prefill`: each phase on its own.

bench decode: decode workers started with bench_dummy_kv and a gateway in
decode_only_bench mode, so requests skip prefill and KV transfer and decode starts
from a dummy-filled latent cache of the chosen input length. For each batch size the
end-to-end decode throughput (through gateway, NATS and SSE) is set against the
forward-only throughput of the same engine code path at the same batch and context
(`bench forward`); the serving overhead is 1 - end_to_end / forward_only.

bench prefill: output length 1, so each request is one prefill; TTFT and prompt
tokens/s against prompt length.

Both take a routing skew and, on a DEP instance, report the balance ratio beside the
throughput; --compare-skew runs balanced and skewed back to back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import nats

from moemesh.tools.bench import forward
from moemesh.tools.bench.env import environment, percentile
from moemesh.tools.bench.serve import runner as serve_runner
from moemesh.tools.bench.serve import workload as wl
from moemesh.tools.bench.serve.client import ClientConfig
from moemesh.shared.eplb.placement import Placement
from moemesh.tools.launch.up import Mesh, UpConfig, ensure_tiny_model, default_home
from moemesh.shared.protocol.messages import ExpertLoad, Heartbeat, StatsRequest, WorkerStats, decode
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.dep_runtime import tensor_from
from moemesh.shared.service.nats_io import request


@dataclass(frozen=True)
class PhaseBenchConfig:
    model: str = ""
    isl: int = 512
    osl: int = 64
    batches: tuple[int, ...] = (8, 32, 64, 128, 256)
    prompt_lens: tuple[int, ...] = (128, 512, 2048)
    requests_per_point: int = 0  # 0: one wave of `batch` (decode), or 4 (prefill)
    dep: int = 1
    skew: str = ""
    compare_skew: bool = False
    threads: int = 1
    seed: int = 0


def _mesh(cfg: PhaseBenchConfig, mode: str, skew: str) -> Mesh:
    model = cfg.model or str(ensure_tiny_model(default_home()))
    worker = [f"num_threads={cfg.threads}", f"skew={skew}", f"max_num_seqs={max(cfg.batches)}",
              f"max_num_batched_tokens={max(max(cfg.batches), max(cfg.prompt_lens) + 16)}",
              "kv_cache_memory_mb=2048", "load_publish_interval_s=0.5"]
    if mode == "decode":
        # No MTP drafts: the forward-only figure it is compared with is the target forward.
        up = UpConfig(model=model, port=0, num_prefill=0, decode_dp=cfg.dep, service_args=tuple(worker),
                      decode_args=("bench_dummy_kv=true", "num_speculative_tokens=0"),
                      gateway_args=("decode_only_bench=true",),
                      balancer=False)
    else:
        up = UpConfig(model=model, port=0, decode_dp=cfg.dep, service_args=tuple(worker), balancer=False)
    return Mesh(up)


def _point(mesh: Mesh, cfg: PhaseBenchConfig, isl: int, osl: int, concurrency: int, n: int) -> dict:
    tok = str(mesh.model)
    work = wl.WorkloadConfig(kind="fixed", num_requests=n, isl=wl.LengthDist("fixed", isl),
                             osl=wl.LengthDist("fixed", osl))
    scfg = serve_runner.ServeBenchConfig(client=ClientConfig(url=mesh.url), workload=work, mode="concurrency",
                                         values=(concurrency,), warmup=min(concurrency, 8), seed=cfg.seed,
                                         tokenizer=tok, progress=False)
    return serve_runner.run(scfg)["points"][0]["summary"]


async def instance_state(mesh: Mesh, dep: int) -> tuple[float | None, list[list[float]]]:
    """(balance ratio of the decode instance over its recent window, rank 0's recent steps)."""
    s = Subjects()
    nc = await nats.connect(mesh.nats_url)
    try:
        worker = "decode-i0-r0" if dep > 1 else None
        ratio = None
        if dep > 1:
            first, loads = await _window(nc, dep)
            ratio = Placement(tensor_from(first.phy2log, len(first.layer_ids)), first.num_experts,
                              dep).instance_ratio(loads)
        if worker is None:
            worker = await _single_decode_id(nc)
        stats = await request(nc, s.stats(worker), StatsRequest(detail=True), WorkerStats, 10)
        return ratio, stats.recent_steps
    finally:
        await nc.close()


async def instance_window(mesh: Mesh, dep: int) -> dict:
    """The decode instance's recent load window, target and draft layers apart
    ({"target": [[count per expert] per layer], "draft": ...}): a recorded skew."""
    from moemesh.tools.bench.eplb_live import split_loads

    nc = await nats.connect(mesh.nats_url)
    try:
        first, loads = await _window(nc, dep)
        return split_loads(first, loads)
    finally:
        await nc.close()


async def _window(nc, dep: int) -> tuple[ExpertLoad, "object"]:
    """(rank 0's load message, the ranks' counts summed [layers, experts])."""
    sub = await nc.subscribe(Subjects().eplb("decode-i0", "load"))
    try:
        seen: dict[int, ExpertLoad] = {}
        while len(seen) < dep:
            m = decode((await sub.next_msg(timeout=20)).data, ExpertLoad)
            seen[m.rank] = m
    finally:
        await sub.unsubscribe()
    first = seen[0]
    return first, sum(tensor_from(m.counts, len(m.layer_ids)) for m in seen.values())


async def _single_decode_id(nc, timeout: float = 10.0) -> str:
    sub = await nc.subscribe(Subjects().heartbeat_all)
    try:
        while True:
            hb = decode((await sub.next_msg(timeout=timeout)).data, Heartbeat)
            if hb.role == "decode":
                return hb.worker_id
    finally:
        await sub.unsubscribe()


def _steps_between(steps: list[list[float]], t0: float, t1: float, batch: int = 0) -> dict:
    """Step-time medians in [t0, t1], over the steps that ran (nearly) the full batch."""
    sel = [s for s in steps if t0 <= s[0] <= t1]
    if batch and sel and len(sel[0]) > 6:
        full = [s for s in sel if s[6] >= 0.9 * batch]
        sel = full or sel
    if not sel:
        return {}
    return {"steps": len(sel), "forward_ms_p50": percentile([s[2] for s in sel], 50) * 1e3,
            "host_ms_p50": percentile([s[3] for s in sel], 50) * 1e3,
            "rank_wait_ms_p50": percentile([s[4] for s in sel], 50) * 1e3,
            "loop_gap_ms_p50": percentile([s[5] for s in sel], 50) * 1e3,
            # The host work the device waited for (all of it, unless the loop overlaps it).
            "host_exposed_ms_p50": percentile([s[7] if len(s) > 7 else s[3] for s in sel], 50) * 1e3,
            "step_ms_p50": percentile([s[1] for s in sel], 50) * 1e3}


def run_decode(cfg: PhaseBenchConfig) -> dict:
    model = cfg.model or str(ensure_tiny_model(default_home()))
    fwd = forward.run(forward.ForwardBenchConfig(model=model, batch_sizes=cfg.batches,
                                                 context_len=cfg.isl + cfg.osl // 2, prefill_lens=(), steps=20,
                                                 warmup=4, num_threads=cfg.threads, seed=cfg.seed))
    fwd_by_b = {r["batch"]: r for r in fwd["decode"]}
    runs = []
    for skew in ([("balanced", ""), ("skewed", cfg.skew)] if cfg.compare_skew else [("run", cfg.skew)]):
        rows = []
        with _mesh(cfg, "decode", skew[1]) as mesh:
            for b in cfg.batches:
                t0 = time.time()
                # One wave of `b` requests that start and end together: no ramp to dilute the batch.
                summ = _point(mesh, cfg, cfg.isl, cfg.osl, b, cfg.requests_per_point or b)
                t1 = time.time()
                ratio, steps = asyncio.run(instance_state(mesh, cfg.dep))
                fo = fwd_by_b[b]["forward_tokens_per_s"]
                tpot = summ["tpot_ms"]["p50"]
                # Steady state as clients see it: b streams, one token each per TPOT. The
                # whole-point rate below also counts the ramp up and down of one wave.
                steady = b / (tpot / 1e3) if tpot else None
                rows.append({"batch": b, "e2e_tokens_per_s": steady, "forward_only_tokens_per_s": fo,
                             "serving_overhead": 1 - steady / fo if fo and steady else None,
                             "whole_point_tokens_per_s": summ["output_tokens_per_s"], "tpot_ms_p50": tpot,
                             "tps_per_user_p90": summ["headline_p90_tps_per_user"], "errors": summ["num_errors"],
                             "balance_ratio": ratio, "decode_steps": _steps_between(steps, t0, t1, b)})
        runs.append({"label": skew[0], "skew": skew[1], "points": rows})
    return {"bench": "decode", "config": asdict(cfg), "env": environment(), "forward_only": fwd["decode"],
            "runs": runs}


def run_prefill(cfg: PhaseBenchConfig) -> dict:
    runs = []
    for skew in ([("balanced", ""), ("skewed", cfg.skew)] if cfg.compare_skew else [("run", cfg.skew)]):
        rows = []
        with _mesh(cfg, "prefill", skew[1]) as mesh:
            for n in cfg.prompt_lens:
                summ = _point(mesh, cfg, n, 1, 1, cfg.requests_per_point or 4)
                ratio, _ = asyncio.run(instance_state(mesh, cfg.dep))
                ttft = summ["ttft_ms"]["p50"]
                rows.append({"prompt_len": n, "ttft_ms_p50": ttft, "ttft_ms_p90": summ["ttft_ms"]["p90"],
                             "prompt_tokens_per_s": n / (ttft / 1e3) if ttft else None,
                             "errors": summ["num_errors"], "balance_ratio": ratio})
        runs.append({"label": skew[0], "skew": skew[1], "points": rows})
    return {"bench": "prefill", "config": asdict(cfg), "env": environment(), "runs": runs}


def decode_table(result: dict) -> str:
    lines = []
    for run in result["runs"]:
        lines.append(f"[{run['label']}{' ' + run['skew'] if run['skew'] else ''}]")
        lines.append(f"{'batch':>6} {'e2e tok/s':>10} {'fwd tok/s':>10} {'overhead':>9} {'TPOT p50':>9} "
                     f"{'fwd/host/wait ms':>18} {'ratio':>6}")
        for p in run["points"]:
            st = p["decode_steps"]
            parts = (f"{st.get('forward_ms_p50', float('nan')):.1f}/{st.get('host_ms_p50', float('nan')):.1f}/"
                     f"{st.get('rank_wait_ms_p50', float('nan')):.1f}")
            ratio = "-" if p["balance_ratio"] is None else f"{p['balance_ratio']:.3f}"
            ov = "-" if p["serving_overhead"] is None else f"{p['serving_overhead']:.1%}"
            lines.append(f"{p['batch']:>6} {_f(p['e2e_tokens_per_s'], '.0f'):>10} "
                         f"{p['forward_only_tokens_per_s']:>10.0f} {ov:>9} {_f(p['tpot_ms_p50']):>9} {parts:>18} "
                         f"{ratio:>6}")
    return "\n".join(lines)


def prefill_table(result: dict) -> str:
    lines = []
    for run in result["runs"]:
        lines.append(f"[{run['label']}{' ' + run['skew'] if run['skew'] else ''}]")
        lines.append(f"{'tokens':>7} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'prompt tok/s':>13} {'ratio':>6}")
        for p in run["points"]:
            ratio = "-" if p["balance_ratio"] is None else f"{p['balance_ratio']:.3f}"
            lines.append(f"{p['prompt_len']:>7} {_f(p['ttft_ms_p50']):>12} {_f(p['ttft_ms_p90']):>12} "
                         f"{_f(p['prompt_tokens_per_s'], '.0f'):>13} {ratio:>6}"
                         + (f"  ({p['errors']} errors)" if p["errors"] else ""))
    return "\n".join(lines)


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)
