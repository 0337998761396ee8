"""`moemesh bench forward`: forward-only step times through the engine's own code path.

Decode: B sequences are given a dummy-filled latent cache of the chosen context length
(no prefill, no transfer) and stepped; the figure is the model forward alone, beside
the whole engine step. Prefill: one prompt of each length, in one chunk.
"""

from __future__ import annotations

import math

import random
from dataclasses import asdict, dataclass

import torch

from moemesh.tools.bench.env import environment, percentile
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.protocol.messages import SamplingParams
from moemesh.shared.model.config import ModelConfig


@dataclass(frozen=True)
class ForwardBenchConfig:
    model: str
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64, 128, 256)
    context_len: int = 512
    prefill_lens: tuple[int, ...] = (128, 512, 2048)
    steps: int = 10
    warmup: int = 3
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int | None = None
    seed: int = 0
    decode_graphs: str = "auto"  # EngineConfig.decode_graphs


def fill_dummy(engine: LLMEngine, request_id: str, context_len: int, params: SamplingParams, rng: random.Random,
               num_drafts: int = 0) -> None:
    """Give a request a random-filled cache of context_len tokens, as if prefilled elsewhere.
    num_drafts: random MTP drafts come with it, as a prefill worker's do, so that its first
    step already verifies and drafts again (a steady MTP step)."""
    vocab = engine.model_config.vocab_size
    n_blocks = engine.blocks.blocks_for(context_len)
    kv = torch.randn(engine.kv_shape(n_blocks), dtype=engine.kv_dtype, device=engine.device)
    ids = [rng.randrange(vocab) for _ in range(context_len + 1)]
    engine.add_prefilled(request_id, ids, context_len, params, kv, [rng.randrange(vocab) for _ in range(num_drafts)])


def run(cfg: ForwardBenchConfig) -> dict:
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    max_b = max(cfg.batch_sizes, default=1)
    max_p = max(cfg.prefill_lens, default=1)
    # The engine's block size: 16, or for DeepSeek-V4 a multiple of every compress rate.
    bs = math.lcm(16, getattr(ModelConfig.from_dir(cfg.model), "block_multiple", 1))
    per_seq = -(-(cfg.context_len + cfg.steps + cfg.warmup + 4) // bs) + 1
    engine = LLMEngine(EngineConfig(
        model=cfg.model, dtype=cfg.dtype, device=cfg.device, num_speculative_tokens=0,
        max_num_seqs=max_b, max_num_batched_tokens=max(max_b, max_p),
        num_kv_blocks=max(max_b * per_seq, -(-max_p // bs) + 2), num_threads=cfg.num_threads,
        max_model_len=max(cfg.context_len + cfg.steps + cfg.warmup + 8, max_p + 2),
        decode_graphs=cfg.decode_graphs,
    ))
    params = SamplingParams(max_tokens=cfg.steps + cfg.warmup + 2, temperature=0, ignore_eos=True)
    decode = []
    for b in cfg.batch_sizes:
        ids = [f"d{b}-{i}" for i in range(b)]
        for rid in ids:
            fill_dummy(engine, rid, cfg.context_len, params, rng)
        fwd, total = [], []
        for i in range(cfg.warmup + cfg.steps):
            engine.step()
            st = engine.last_stats
            if i >= cfg.warmup:
                fwd.append(st.forward_s)
                total.append(st.total_s)
        for rid in ids:
            engine.abort(rid)
        f50 = percentile(fwd, 50)
        decode.append({
            "batch": b, "context_len": cfg.context_len,
            "forward_ms_p50": f50 * 1e3, "forward_ms_p90": percentile(fwd, 90) * 1e3,
            "step_ms_p50": percentile(total, 50) * 1e3,
            "forward_tokens_per_s": b / f50, "step_tokens_per_s": b / percentile(total, 50),
        })
    prefill = []
    for n in cfg.prefill_lens:
        fwd = []
        for i in range(max(1, cfg.steps // 3) + 1):
            rid = f"p{n}-{i}"
            engine.add_request(rid, [rng.randrange(engine.model_config.vocab_size) for _ in range(n)],
                               SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            engine.step()
            if i:  # the first is warm-up
                fwd.append(engine.last_stats.forward_s)
        f50 = percentile(fwd, 50)
        prefill.append({"prompt_len": n, "forward_ms_p50": f50 * 1e3, "tokens_per_s": n / f50})
    return {
        "bench": "forward",
        "config": asdict(cfg),
        "model": engine.model_config.identity() | {"path": cfg.model},
        "env": environment(cfg.device),
        "decode": decode,
        "prefill": prefill,
    }


def table(result: dict) -> str:
    lines = [f"decode @ context {result['config']['context_len']}",
             f"{'batch':>6} {'fwd ms':>9} {'fwd tok/s':>11} {'step ms':>9} {'step tok/s':>11}"]
    for r in result["decode"]:
        lines.append(f"{r['batch']:>6} {r['forward_ms_p50']:>9.2f} {r['forward_tokens_per_s']:>11.0f} "
                     f"{r['step_ms_p50']:>9.2f} {r['step_tokens_per_s']:>11.0f}")
    lines.append("prefill")
    lines.append(f"{'tokens':>6} {'fwd ms':>9} {'tok/s':>11}")
    for r in result["prefill"]:
        lines.append(f"{r['prompt_len']:>6} {r['forward_ms_p50']:>9.2f} {r['tokens_per_s']:>11.0f}")
    return "\n".join(lines)
