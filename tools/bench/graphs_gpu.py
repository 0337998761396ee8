"""`python -m moemesh.tools.bench.graphs_gpu`: decode steps replayed as CUDA graphs, checked
and timed against the same steps run op by op, on a CUDA machine.

1. exactness: the same requests (greedy and seeded, the batch shrinking as they finish)
   through three engines on one model: decode_graphs "on" (captured, replayed), "eager"
   (the same static buffers, uncaptured) and "off" (the dynamic path). A replay runs
   the eager path's kernels on the eager path's shapes, so "on" must equal "eager" bit
   for bit, tokens and cache; against "off" (other shapes, so other tilings) the tokens
   are compared and the cache's largest difference reported.
2. host time: bench forward's decode sweep with graphs on and off (the step, the
   forward, and the step's time outside the forward).

It writes JSON (--out) and prints a summary. `--smoke` runs on a CPU with "eager" in
place of "on" and "off" alone timed, to test this script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback

import torch

from moemesh.shared.checkpoint.loader import load_model
from moemesh.shared.checkpoint.writer import init_model
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.protocol.messages import SamplingParams
from moemesh.tools.bench import forward


def _requests(eng: LLMEngine, n: int) -> None:
    for i in range(n):
        sampled = i % 3 == 0
        params = SamplingParams(max_tokens=4 + 5 * (i % 5), temperature=0.8 if sampled else 0.0,
                                seed=11 + i if sampled else None, ignore_eos=True)
        eng.add_request(f"r{i}", [(17 * i + j) % 200 + 1 for j in range(5 + 3 * i)], params)


def generate(model_dir: str, model, mode: str, device: str, dtype: str, n: int) -> tuple[dict, torch.Tensor]:
    eng = LLMEngine(EngineConfig(model=model_dir, device=device, dtype=dtype, num_speculative_tokens=0,
                                 max_model_len=512, max_num_seqs=max(n, 1), num_kv_blocks=64 * n,
                                 decode_graphs=mode), model=model)
    _requests(eng, n)
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    used = eng.kv.tensor[:, : eng.kv.num_blocks]
    return out, used.float().cpu()


def exactness(model_dir: str, device: str, dtype: str, graph_mode: str, n: int = 24) -> dict:
    model = load_model(model_dir, {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                   "float16": torch.float16}[dtype], torch.device(device))
    runs = {mode: generate(model_dir, model, mode, device, dtype, n) for mode in (graph_mode, "eager", "off")}
    (g_ids, g_kv), (e_ids, e_kv), (o_ids, o_kv) = runs[graph_mode], runs["eager"], runs["off"]
    agree = sum(g_ids[r] == o_ids[r] for r in o_ids)
    return {
        "dtype": dtype, "requests": n,
        "graph_equals_eager": g_ids == e_ids and torch.equal(g_kv, e_kv),
        "tokens_equal_to_dynamic": agree, "cache_max_abs_diff_vs_dynamic": float((g_kv - o_kv).abs().max()),
    }


def host_time(model_dir: str, device: str, dtype: str, modes: tuple[str, ...], batch_sizes: tuple[int, ...]) -> dict:
    out = {}
    for mode in modes:
        res = forward.run(forward.ForwardBenchConfig(model=model_dir, batch_sizes=batch_sizes, context_len=512,
                                                     prefill_lens=(), steps=20, warmup=5, dtype=dtype,
                                                     device=device, decode_graphs=mode))
        out[mode] = [{"batch": r["batch"], "step_ms": r["step_ms_p50"], "forward_ms": r["forward_ms_p50"],
                      "outside_forward_ms": r["step_ms_p50"] - r["forward_ms_p50"]} for r in res["decode"]]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="graphs_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: a tiny checkpoint written here)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--out", default="graphs_gpu.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, eager in place of capture")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    graph_mode = "eager" if args.smoke else "on"
    dtypes = ("float32",) if args.smoke else tuple(args.dtypes.split(","))
    sizes = (1, 4) if args.smoke else tuple(int(b) for b in args.batch_sizes.split(","))
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "sections": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(init_model(tmp, "tiny", seed=0))
        sections = {f"exactness-{d}": (lambda d=d: exactness(model_dir, device, d, graph_mode, 6 if args.smoke else 24))
                    for d in dtypes}
        sections["host-time"] = lambda: host_time(model_dir, device, dtypes[-1],
                                                  ("off",) if args.smoke else ("off", "on"), sizes)
        for name, fn in sections.items():
            t0 = time.perf_counter()
            try:
                result["sections"][name] = {"ok": True, "result": fn()}
            except Exception as e:  # noqa: BLE001 - a failed section is recorded and the rest run
                result["sections"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                            "traceback": traceback.format_exc()}
            result["sections"][name]["seconds"] = round(time.perf_counter() - t0, 1)
            print(name, json.dumps(result["sections"][name].get("result") or result["sections"][name]["error"]),
                  flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    exact = all(s["result"].get("graph_equals_eager", True) for s in result["sections"].values() if s["ok"])
    return 0 if exact and all(s["ok"] for s in result["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
