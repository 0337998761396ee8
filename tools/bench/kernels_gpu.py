"""`python -m moemesh.tools.bench.kernels_gpu`: every Triton kernel against its torch reference
and the hardware roofline, then `bench forward`'s decode sweep on a real-sized model.

Run on a CUDA machine with torch and triton; nothing else is needed. It writes JSON
(--out) and prints a table, in well under five minutes on an H200:
1. kernels: each case (bench_cases.py) is checked against its reference, then timed
   with CUDA events, the L2 flushed before every launch, the median kept;
2. forward: a random-weight checkpoint with the real dimensions of --preset and only
   --num-layers layers is written to a temporary directory, and the decode sweep runs
   twice, MOEMESH_KERNELS=torch and then triton.
A section that fails is recorded with its error and the run goes on. `--smoke` runs
tiny shapes on CPU under TRITON_INTERPRET=1, to test this script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch

from moemesh.tools.bench import kernel_cases as bench_cases


@dataclass(frozen=True)
class Hardware:
    name: str = "H200"
    hbm_bytes_per_s: float = 4.8e12
    # Dense bf16 as the issue records it (the SXM datasheet says 989e12); used for every dtype.
    peak_flops_per_s: float = 790e12


@dataclass(frozen=True)
class BenchGpuConfig:
    out: str = "bench_gpu.json"
    device: str = "cuda"
    dtype: str = "bfloat16"
    warmup: int = 5
    iters: int = 20
    forward: bool = True
    preset: str = "v2-lite"  # "v3" with 4 layers writes ~45 GB of weights: minutes, not seconds
    num_layers: int = 4
    model_dir: str | None = None  # reuse a checkpoint instead of writing one
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64, 128)
    context_len: int = 1024
    budget_s: float = 270.0  # sections still waiting when this runs out are skipped
    smoke: bool = False
    hardware: Hardware = Hardware()


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], Any], device: str, warmup: int, iters: int) -> float:
    """Median milliseconds of one call; on CUDA, timed with events on a cold L2."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if not device.startswith("cuda"):
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)  # larger than any L2
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _max_err(a: Any, b: Any) -> float:
    if isinstance(a, tuple):
        return max(_max_err(x, y) for x, y in zip(a, b))
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def run_kernels(cfg: BenchGpuConfig, deadline: float) -> list[dict]:
    dims = bench_cases.SMOKE if cfg.smoke else bench_cases.Dims()
    dtype, hw, rows = _DTYPES[cfg.dtype], cfg.hardware, []
    os.environ["MOEMESH_KERNELS"] = "triton"
    for build in bench_cases.ALL:
        if time.monotonic() > deadline:
            rows.append({"op": build.__name__, "skipped": "time budget spent"})
            continue
        try:
            for case in build(dims, dtype, cfg.device):
                err = _max_err(case.kernel(), case.ref())
                t_kernel = time_ms(case.kernel, cfg.device, cfg.warmup, cfg.iters)
                t_ref = time_ms(case.ref, cfg.device, cfg.warmup, cfg.iters)
                t_mem, t_math = case.bytes / hw.hbm_bytes_per_s * 1e3, case.flops / hw.peak_flops_per_s * 1e3
                rows.append({
                    "op": case.op, "shape": case.shape, "max_abs_err": err,
                    "triton_ms": t_kernel, "torch_ms": t_ref, "roofline_ms": max(t_mem, t_math),
                    "bound": "memory" if t_mem >= t_math else "compute",
                    "speedup_vs_torch": t_ref / t_kernel, "fraction_of_roofline": max(t_mem, t_math) / t_kernel,
                    "achieved_gb_per_s": case.bytes / t_kernel / 1e6,
                    "achieved_tflop_per_s": case.flops / t_kernel / 1e9,
                })
                del case
        except Exception as e:  # keep the other ops' figures
            rows.append({"op": build.__name__, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
        if cfg.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def run_forward(cfg: BenchGpuConfig) -> dict:
    from moemesh.tools.bench.forward import ForwardBenchConfig, run
    from moemesh.shared.checkpoint.writer import init_model

    preset = "tiny" if cfg.smoke else cfg.preset
    out: dict[str, Any] = {"preset": preset, "num_layers": cfg.num_layers}
    with tempfile.TemporaryDirectory(prefix="moemesh-bench-") as tmp:
        model = cfg.model_dir
        if model is None:
            t0 = time.monotonic()
            model = str(init_model(tmp, preset, num_layers=cfg.num_layers, dtype=cfg.dtype))
            out["init_model_s"] = time.monotonic() - t0
        fcfg = ForwardBenchConfig(
            model=model, batch_sizes=cfg.batch_sizes, context_len=cfg.context_len, prefill_lens=(),
            steps=2 if cfg.smoke else 10, warmup=1 if cfg.smoke else 3, dtype=cfg.dtype, device=cfg.device,
        )
        for mode in ("torch", "triton"):
            os.environ["MOEMESH_KERNELS"] = mode
            out[mode] = run(fcfg)["decode"]
    return out


def run_all(cfg: BenchGpuConfig) -> dict:
    from moemesh.tools.bench.env import environment

    start = time.monotonic()
    deadline = start + cfg.budget_s
    result: dict[str, Any] = {"bench": "kernels", "config": asdict(cfg), "env": environment(cfg.device)}
    result["kernels"] = run_kernels(cfg, deadline)
    if cfg.forward:
        if time.monotonic() > deadline:
            result["forward"] = {"skipped": "time budget spent"}
        else:
            try:
                result["forward"] = run_forward(cfg)
            except Exception as e:
                result["forward"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    result["elapsed_s"] = time.monotonic() - start
    return result


def table(result: dict) -> str:
    lines = [f"{'op':<18} {'shape':<34} {'triton ms':>10} {'torch ms':>10} {'roof ms':>9} {'x torch':>8} "
             f"{'%roof':>6} {'GB/s':>8} {'TFLOP/s':>8} {'max err':>9}"]
    for r in result["kernels"]:
        if "triton_ms" not in r:
            lines.append(f"{r['op']:<18} {r.get('error') or r.get('skipped')}")
            continue
        lines.append(f"{r['op']:<18} {r['shape']:<34} {r['triton_ms']:>10.4f} {r['torch_ms']:>10.4f} "
                     f"{r['roofline_ms']:>9.4f} {r['speedup_vs_torch']:>8.2f} {100 * r['fraction_of_roofline']:>6.1f} "
                     f"{r['achieved_gb_per_s']:>8.0f} {r['achieved_tflop_per_s']:>8.1f} {r['max_abs_err']:>9.2e}")
    fwd = result.get("forward")
    if fwd and "torch" in fwd:
        lines.append(f"\ndecode forward, {fwd['preset']} x{fwd['num_layers']} layers (ms p50, torch -> triton)")
        for a, b in zip(fwd["torch"], fwd["triton"]):
            lines.append(f"  batch {a['batch']:>4} @ {a['context_len']}: {a['forward_ms_p50']:9.2f} -> "
                         f"{b['forward_ms_p50']:9.2f}   ({a['forward_ms_p50'] / b['forward_ms_p50']:.2f}x)")
    elif fwd:
        lines.append(f"\nforward: {fwd.get('error') or fwd.get('skipped')}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> BenchGpuConfig:
    p = argparse.ArgumentParser(prog="python -m moemesh.tools.bench.kernels_gpu", description=__doc__.split("\n")[0])
    d = BenchGpuConfig()
    p.add_argument("--out", default=d.out, help="JSON output path")
    p.add_argument("--dtype", default=d.dtype, choices=list(_DTYPES))
    p.add_argument("--iters", type=int, default=d.iters)
    p.add_argument("--preset", default=d.preset, help="model preset for the forward sweep (v2-lite, v3)")
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--model-dir", default=None, help="use this checkpoint for the forward sweep")
    p.add_argument("--context-len", type=int, default=d.context_len)
    p.add_argument("--no-forward", action="store_true", help="kernels only")
    p.add_argument("--budget-s", type=float, default=d.budget_s)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (needs TRITON_INTERPRET=1)")
    a = p.parse_args(argv)
    cfg = replace(d, out=a.out, dtype=a.dtype, iters=a.iters, preset=a.preset, num_layers=a.num_layers,
                  model_dir=a.model_dir, context_len=a.context_len, forward=not a.no_forward, budget_s=a.budget_s)
    if a.smoke:
        cfg = replace(cfg, smoke=True, device="cpu", dtype="float32", warmup=1, iters=1, num_layers=2,
                      batch_sizes=(1, 2), context_len=9)
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if not cfg.smoke and not torch.cuda.is_available():
        print("bench_gpu needs a CUDA device (or --smoke, on CPU under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    result = run_all(cfg)
    with open(cfg.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(table(result))
    print(f"\nwrote {cfg.out} in {result['elapsed_s']:.0f}s")
    failed = any("error" in r for r in result["kernels"]) or "error" in result.get("forward", {})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
