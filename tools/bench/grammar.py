"""The step-time cost of structured output: decode steps at a fixed batch with none, then
some, of the requests under a JSON Schema grammar.

The engine runs planned steps (schedule, forward, mask + sample + advance, land) on the
mock model by default, whose step costs no device time: what is left is the host work of a
step, which is where the grammar's cost lands (the masks are computed on the CPU, the
bitmask applied where the logits are). --vocab-size widens the mock's logits to a real
checkpoint's vocabulary (DeepSeek-V3's 129280), so that the masks are applied at full
width; the grammar's own work is per token of the checkpoint's tokenizer.

Besides the step's wall time, the engine's grammar runtime counts its own time (masks
computed and applied, matchers fed): `grammar ms` is that per step, the part of the cost
that noise on a shared machine cannot hide.

The batch is kept full: a request that finishes (a grammar completes its JSON) is replaced
by a new one at once, so every measured step samples `batch` rows, `constrained` of them
under the grammar.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.engine.mock_model import MockModel
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.protocol.messages import GrammarSpec, SamplingParams
from moemesh.tools.bench.env import environment, percentile

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


@dataclass(frozen=True)
class GrammarBenchConfig:
    model: str
    batch: int = 64
    constrained: tuple[int, ...] = (0, 32)  # constrained requests per batch, one run each
    steps: int = 50
    warmup: int = 5
    context_len: int = 128
    mock: bool = True
    vocab_size: int = 0  # 0: the checkpoint's
    threads: int = 1
    seed: int = 0


def run(cfg: GrammarBenchConfig) -> dict:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    mcfg = ModelConfig.from_dir(cfg.model)
    if cfg.vocab_size:
        mcfg = dataclasses.replace(mcfg, vocab_size=cfg.vocab_size)
    model = MockModel(mcfg, 0.0) if cfg.mock else None
    bs = 16
    per_seq = -(-(cfg.context_len + 4 * (cfg.steps + cfg.warmup)) // bs) + 2
    eng = LLMEngine(EngineConfig(
        model=cfg.model, num_speculative_tokens=0, max_num_seqs=cfg.batch, max_num_batched_tokens=cfg.batch,
        num_kv_blocks=cfg.batch * per_seq + 8, num_threads=cfg.threads, enable_prefix_caching=False,
        max_model_len=cfg.context_len + 4 * (cfg.steps + cfg.warmup) + 8), model=model)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    first = _first_token(eng, spec)
    runs = []
    counter = iter(range(1 << 30))
    for n_con in cfg.constrained:
        steps, samples, rows, gram = [], [], [], []
        for i in range(cfg.warmup + cfg.steps):
            have = sum(s.matcher is not None for s in eng.seqs.values())
            for _ in range(n_con - have):
                _add(eng, f"c{next(counter)}", spec, first, cfg, rng)
            for _ in range(cfg.batch - len(eng.seqs)):
                _add(eng, f"f{next(counter)}", None, rng.randrange(4, mcfg.vocab_size), cfg, rng)
            busy = eng.grammar.busy_s
            t = time.perf_counter()
            out = eng.step()
            wall = time.perf_counter() - t  # the mock's own clock has no time in it: this is the step
            st = eng.last_stats
            if i >= cfg.warmup:
                steps.append(wall)
                samples.append(st.sample_s)
                rows.append(len(out))
                gram.append(eng.grammar.busy_s - busy)
        for rid in list(eng.seqs):
            eng.abort(rid)
        runs.append({"batch": cfg.batch, "constrained": n_con, "rows_p50": percentile(rows, 50),
                     "step_ms_p50": percentile(steps, 50) * 1e3, "step_ms_p90": percentile(steps, 90) * 1e3,
                     "sample_ms_p50": percentile(samples, 50) * 1e3,
                     "grammar_ms_p50": percentile(gram, 50) * 1e3, "grammar_ms_p90": percentile(gram, 90) * 1e3})
    base = runs[0]
    for r in runs:
        r["step_ms_added"] = r["step_ms_p50"] - base["step_ms_p50"]
        r["sample_ms_added"] = r["sample_ms_p50"] - base["sample_ms_p50"]
    return {"bench": "grammar", "config": asdict(cfg), "vocab_size": mcfg.vocab_size, "schema": SCHEMA,
            "env": environment("cpu"), "runs": runs}


def _first_token(eng: LLMEngine, spec: GrammarSpec) -> int:
    """A token the grammar allows first (every constrained request starts from one, as
    after a prefill elsewhere)."""
    m = eng.grammar.matcher(spec)
    logits = torch.zeros(1, eng.model_config.vocab_size)
    eng.grammar.mask(logits, [(0, m)])
    return int(logits[0].isfinite().nonzero()[0])


def _add(eng: LLMEngine, rid: str, spec, first: int, cfg: GrammarBenchConfig, rng: random.Random) -> None:
    vocab = eng.model_config.vocab_size
    ids = [rng.randrange(4, vocab) for _ in range(cfg.context_len)] + [first]
    n_blocks = eng.blocks.blocks_for(cfg.context_len)
    kv = torch.zeros(eng.kv_shape(n_blocks), dtype=eng.kv_dtype)
    params = SamplingParams(max_tokens=4 * (cfg.steps + cfg.warmup), temperature=1.0, ignore_eos=spec is None,
                            grammar=spec)
    eng.add_prefilled(rid, ids, cfg.context_len, params, kv)


def table(result: dict) -> str:
    lines = [f"decode steps at batch {result['config']['batch']}, vocab {result['vocab_size']}, "
             f"{'mock' if result['config']['mock'] else 'model'} forward",
             f"{'constrained':>11} {'rows':>5} {'step ms p50':>12} {'p90':>8} {'sample ms':>10} {'added ms':>9} "
             f"{'grammar ms':>11} {'p90':>7}"]
    for r in result["runs"]:
        lines.append(f"{r['constrained']:>11} {r['rows_p50']:>5.0f} {r['step_ms_p50']:>12.3f} {r['step_ms_p90']:>8.3f} "
                     f"{r['sample_ms_p50']:>10.3f} {r['step_ms_added']:>9.3f} {r['grammar_ms_p50']:>11.3f} "
                     f"{r['grammar_ms_p90']:>7.3f}")
    return "\n".join(lines)
