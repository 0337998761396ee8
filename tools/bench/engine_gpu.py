"""`python -m moemesh.tools.bench.engine_gpu`: the engine on a device against the engine on
the CPU, and its bf16 against transformers' own.

For each model (tiny and v4-tiny, written by `moemesh init-model`), the same greedy
prompts (lengths from the oracle's, hf_oracle.py) run:
1. fp32: on the CPU (the torch path, which tests/oracle holds to transformers), then on
   --device (on CUDA the Triton kernels and decode graphs, as a worker runs them). The
   token ids must be equal, prompt by prompt.
2. bf16: on --device, compared with its fp32 there: the share of prompts whose answer is
   the same. transformers' bf16 against its fp32, on the same device and prompts, gives
   the share to meet; falling short of it by more than --bf16-tolerance fails. On a CPU
   both shares are recorded and not judged: the target is a GPU's.
3. sampled: the same prompts, every other one sampled (seeded; temperature, top-k and
   top-p), beside greedy ones, with the MTP draft head verifying one draft a step where
   the model has one, fp32 on --device and on the CPU. An error fails the part; the share
   of equal answers is recorded and not judged (a near-tie may draw differently).

It writes JSON (--out) with a verdict and a one-line summary, and prints the summary.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch

from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.llm import LLM
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.protocol.messages import SamplingParams
from moemesh.tools.bench import hf_oracle

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineCheckConfig:
    models: tuple[tuple[str, str], ...]  # (name, model directory)
    device: str = "cuda"
    num_prompts: int = 32
    new_tokens: int = hf_oracle.NEW_TOKENS
    bf16_tolerance: float = 0.1  # the engine's bf16 share may fall this far below transformers'
    seed: int = 0


def prompt_set(vocab: int, n: int, seed: int) -> list[list[int]]:
    """n prompts whose lengths spread over the oracle's: every one of them once n reaches
    their number, an even pick of them below it."""
    lens = hf_oracle.PROMPT_LENS
    rng = random.Random(seed)
    picks = [lens[i % len(lens)] for i in range(n)] if n >= len(lens) else [lens[i * len(lens) // n] for i in range(n)]
    return [hf_oracle.draw_prompt(rng, k, vocab) for k in picks]


def sampled_params(n: int, new_tokens: int) -> list[SamplingParams]:
    """Every other prompt greedy, the rest seeded and sampled three ways."""
    kinds = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.3), dict(temperature=0.7, top_k=20)]
    out = []
    for i in range(n):
        how = {"temperature": 0} if i % 2 == 0 else {**kinds[i // 2 % 3], "seed": i}
        out.append(SamplingParams(max_tokens=new_tokens, ignore_eos=True, **how))
    return out


def engine_ids(model_dir: str, device: str, dtype: str, prompts: list[list[int]], new_tokens: int,
               params: list[SamplingParams] | None = None, spec_tokens: int = 0) -> list[list[int]]:
    """Each prompt's ids (greedy unless params say), batched through the engine as a worker
    configures it."""
    bs = math.lcm(16, getattr(ModelConfig.from_dir(model_dir), "block_multiple", 1))
    blocks = sum(-(-(len(p) + new_tokens + spec_tokens) // bs) + 1 for p in prompts) + 2
    cfg = EngineConfig(model=model_dir, device=device, dtype=dtype, max_num_seqs=len(prompts), num_kv_blocks=blocks,
                       num_speculative_tokens=spec_tokens)
    params = params or SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    out = [c.token_ids for c in LLM(cfg).generate(prompts, params)]
    gc.collect()  # the engine's graphs and cache, before the next run allocates its own
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def transformers_ids(model_dir: str, device: str, dtype: str, prompts: list[list[int]],
                     new_tokens: int) -> list[list[int]]:
    hf = hf_oracle.load(model_dir, _DTYPES[dtype], device)
    try:
        return hf_oracle.greedy(hf, prompts, new_tokens)
    finally:
        del hf
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many answers are equal, and where the first few that are not part."""
    diffs = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            diffs.append({"prompt": i, "first_diff_at": at})
    return {"equal": len(a) - len(diffs), "of": len(a), "first_diffs": diffs[:8]}


def explain(model_dir: str, prompts: list[list[int]], cpu_ids: list[list[int]], diffs: list[dict]) -> None:
    """Adds transformers' fp32 top-2 gap at each first difference (on the CPU's answer): a
    gap near zero is a near-tie that rounding decides, a wide one a wrong result."""
    if not diffs:
        return
    try:
        hf = hf_oracle.load(model_dir)
        for d in diffs:
            d["top2_gap"] = hf_oracle.top2_gap(hf, prompts[d["prompt"]], cpu_ids[d["prompt"]], d["first_diff_at"])
    except Exception as e:  # noqa: BLE001 - an explanation that fails leaves the differences as they are
        diffs[0]["top2_gap_error"] = f"{type(e).__name__}: {e}"


def bf16_verdict(engine: dict, hf: dict | None, tolerance: float, judged: bool, hf_failed: str = "") -> dict:
    """The bf16 shares, and whether the engine's meets transformers' (None: not judged)."""
    out = {"engine_share": engine["equal"] / engine["of"], "engine": engine}
    if hf is None:
        return out | {"pass": None, "why": hf_failed or "no transformers answers to compare with"}
    out |= {"transformers_share": hf["equal"] / hf["of"], "transformers": hf, "tolerance": tolerance}
    if not judged:
        return out | {"pass": None, "why": "recorded, not judged: the bf16 target is for a GPU"}
    return out | {"pass": out["engine_share"] >= out["transformers_share"] - tolerance}


def _transformers_runs(model_dir: str, cfg: EngineCheckConfig, prompts: list[list[int]]) -> tuple[dict | None, str]:
    """transformers' answers in each dtype on the device, or why there are none."""
    try:
        return {dtype: transformers_ids(model_dir, cfg.device, dtype, prompts, cfg.new_tokens) for dtype in _DTYPES}, ""
    except ImportError:
        return None, "transformers is not installed: nothing to compare with"
    except Exception as e:  # noqa: BLE001 - the engine's own figures still stand
        return None, f"transformers failed: {type(e).__name__}: {e}"


def check_model(name: str, model_dir: str, cfg: EngineCheckConfig) -> dict:
    t0 = time.monotonic()
    prompts = prompt_set(ModelConfig.from_dir(model_dir).vocab_size, cfg.num_prompts, cfg.seed)
    run = {"cpu-float32": engine_ids(model_dir, "cpu", "float32", prompts, cfg.new_tokens)}
    for dtype in _DTYPES:
        run[f"device-{dtype}"] = engine_ids(model_dir, cfg.device, dtype, prompts, cfg.new_tokens)
    sampled = sampled_params(len(prompts), cfg.new_tokens)
    spec = 1 if ModelConfig.from_dir(model_dir).num_nextn_predict_layers else 0
    for where in dict.fromkeys(("cpu", cfg.device)):
        run[f"{where}-sampled"] = engine_ids(model_dir, where, "float32", prompts, cfg.new_tokens, sampled, spec)
    fp32 = agreement(run["device-float32"], run["cpu-float32"])
    explain(model_dir, prompts, run["cpu-float32"], fp32["first_diffs"])
    hf, hf_failed = _transformers_runs(model_dir, cfg, prompts)
    hf_bf16 = agreement(hf["bfloat16"], hf["float32"]) if hf else None
    bf16 = bf16_verdict(agreement(run["device-bfloat16"], run["device-float32"]), hf_bf16, cfg.bf16_tolerance,
                        judged=cfg.device.startswith("cuda"), hf_failed=hf_failed)
    return {
        "model": name, "path": model_dir, "prompt_lens": [len(p) for p in prompts],
        "fp32_equal_to_cpu": fp32["equal"] == fp32["of"], "fp32": fp32, "bf16": bf16,
        "engine_fp32_vs_transformers_fp32": agreement(run["device-float32"], hf["float32"]) if hf else None,
        "sampled": {"spec_tokens": spec, **agreement(run[f"{cfg.device}-sampled"], run["cpu-sampled"]),
                    "lengths_ok": all(len(x) == cfg.new_tokens for x in run[f"{cfg.device}-sampled"])},
        "seconds": round(time.monotonic() - t0, 1),
    }


def checked(name: str, model_dir: str, cfg: EngineCheckConfig) -> dict:
    """check_model, or the error that stopped it (the other models still run)."""
    try:
        return check_model(name, model_dir, cfg)
    except Exception as e:  # noqa: BLE001 - recorded as this model's failure
        return {"model": name, "path": model_dir, "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()}


def _gaps(diffs: list[dict]) -> str:
    gaps = [d["top2_gap"] for d in diffs if "top2_gap" in d]
    return f" (transformers' top-2 gap there: {', '.join(f'{g:.2g}' for g in gaps)})" if gaps else ""


def verdict(models: dict[str, dict]) -> tuple[str, str, str]:
    """(verdict, reason, one-line summary) of the part."""
    bad = [f"{n}: {m['error']}" for n, m in models.items() if "error" in m]
    models = {n: m for n, m in models.items() if "error" not in m}
    bad += [f"{n}: fp32 on the device differs from the CPU on {m['fp32']['of'] - m['fp32']['equal']} prompts"
            + _gaps(m["fp32"]["first_diffs"]) for n, m in models.items() if not m["fp32_equal_to_cpu"]]
    bad += [f"{n}: bf16 agrees with fp32 on {m['bf16']['engine_share']:.0%}, transformers' on "
            f"{m['bf16']['transformers_share']:.0%}" for n, m in models.items() if m["bf16"]["pass"] is False]
    bad += [f"{n}: a sampled answer came back short" for n, m in models.items()
            if not m["sampled"]["lengths_ok"]]
    parts = []
    for n, m in models.items():
        b = m["bf16"]
        hf = f", transformers {b['transformers_share']:.0%}" if "transformers_share" in b else ""
        judged = "" if b["pass"] is not None else f" (not judged: {b['why']})" if "transformers_share" not in b \
            else " (not judged)"
        sm = m["sampled"]
        parts.append(f"{n} fp32 = CPU on {m['fp32']['equal']}/{m['fp32']['of']}, "
                     f"bf16 = fp32 on {b['engine_share']:.0%}{hf}{judged}, "
                     f"sampled = CPU on {sm['equal']}/{sm['of']} (not judged)")
    return ("fail" if bad else "pass"), "; ".join(bad), "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="engine_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", required=True, help="NAME=DIR,... (e.g. tiny=/tmp/tiny,v4-tiny=/tmp/v4)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=EngineCheckConfig.num_prompts)
    ap.add_argument("--new-tokens", type=int, default=EngineCheckConfig.new_tokens)
    ap.add_argument("--bf16-tolerance", type=float, default=EngineCheckConfig.bf16_tolerance)
    ap.add_argument("--out", default="engine.json")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("engine_gpu: no CUDA device (run with --device cpu to test the script)", file=sys.stderr)
        return 2
    models = tuple(tuple(m.split("=", 1)) for m in a.models.split(","))
    cfg = EngineCheckConfig(models, a.device, a.num_prompts, a.new_tokens, a.bf16_tolerance)
    result = {"config": asdict(cfg), "models": {name: checked(name, path, cfg) for name, path in cfg.models}}
    result["verdict"], result["reason"], result["summary"] = verdict(result["models"])
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(result["summary"] + (f"\nFAIL: {result['reason']}" if result["reason"] else ""))
    return 0 if result["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
