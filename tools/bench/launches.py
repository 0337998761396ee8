"""`moemesh bench launches`: kernel launches and host syncs of one engine step.

For each batch size B, B sequences get a cache of `context_len` tokens (as bench
forward gives them, no prefill) and one decode step is counted; then one prompt of
`prefill_len` tokens is prefilled in one chunk and that step is counted. Counts are
deterministic, so one step says it all.

The kernel path (`kernels="triton"`) is the op stream a GPU would get: on a CPU the
kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by the command before
triton loads), whose own work is not counted. The step is charged by scope:
- `plan`: scheduling and the batch's metadata (positions, slots, tables, V4's ring and
  entry addresses), host work that on a GPU ends in copies to the device;
- `layer.{i}` (and `mtp.{j}`): each decoder layer's forward;
- `model`: the embedding, the final norm and head, and sampling, outside the layers;
- `land`: writing the sampled ids into the sequences. It works on the host's copy of
  them, so it launches nothing on a GPU: its ops are listed, not counted in the totals.
The step's read of its sampled ids (`.cpu()`, invisible on a CPU) is the one sync a
decode step must have, and the batch's copy to the device (one, packed: runner.pack)
its one transfer; on a CPU both are added to the counts.

On a CUDA device (`device="cuda"`) the kernels are compiled and the copies are seen as
the ops they are. Decode graphs stay off either way: the count is the op stream a step
issues, which a captured graph replays in one call.
"""

from __future__ import annotations

import math
import os
import random
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine import host_copy
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.kernels.dispatch import ENV_VAR
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.protocol.messages import SamplingParams
from moemesh.tools.bench.env import environment
from moemesh.tools.bench.forward import fill_dummy
from moemesh.tools.bench.launch_count import LaunchCounter, counting_triton


@dataclass(frozen=True)
class LaunchesBenchConfig:
    model: str
    batch_sizes: tuple[int, ...] = (1, 16)
    # The step computes position context_len: at 511 every V4 compressor (rates 4 .. 512)
    # completes a group and pools, the most a step launches.
    context_len: int = 511
    prefill_len: int = 128
    kernels: str = "triton"  # the kernel path, or "torch" for the CPU reference path
    top: int = 12
    seed: int = 0
    spec_tokens: int = 0  # > 0: also count an MTP step (verify that many drafts, draft as many)
    device: str = "cpu"


def _engine(cfg: LaunchesBenchConfig, spec_tokens: int = 0) -> LLMEngine:
    max_b = max(cfg.batch_sizes)
    bs = math.lcm(16, getattr(ModelConfig.from_dir(cfg.model), "block_multiple", 1))
    per_seq = -(-(cfg.context_len + 8) // bs) + 1
    return LLMEngine(EngineConfig(
        model=cfg.model, num_speculative_tokens=spec_tokens, max_num_seqs=max_b,
        max_num_batched_tokens=max(max_b * (1 + spec_tokens), cfg.prefill_len), num_threads=1,
        num_kv_blocks=max_b * per_seq + -(-cfg.prefill_len // bs) + 2,
        max_model_len=max(cfg.context_len, cfg.prefill_len) + 16, enable_prefix_caching=False,
        device=cfg.device, decode_graphs="off",
    ))


def _hooks(counter: LaunchCounter, model) -> list:
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles += counter.hook(layer, f"layer.{i}")
    for j, layer in enumerate(getattr(model, "mtp", [])):
        handles += counter.hook(layer, f"mtp.{j}")
    return handles


def count_step(engine: LLMEngine, top: int) -> dict:
    """Counts one plan -> run -> land step of the engine (it must have work)."""
    counter = LaunchCounter()
    handles = _hooks(counter, engine.model)
    try:
        with counting_triton(counter), _counting_reads(counter), counter, torch.inference_mode():
            with counter.scoped("plan"):
                step = engine.plan_step()
            with counter.scoped("model"):
                engine.run_step(step)
            with counter.scoped("land"):
                engine.land_step(step)
    finally:
        for h in handles:
            h.remove()
    if engine.device.type == "cpu":  # a GPU engine copies the batch's index tensors over, packed in one buffer
        counter.launches["plan"]["copy to device"] += 1
    land = {"ops": sum(counter.launches.pop("land", {}).values()), "host_reads": sum(counter.syncs.pop("land", {}).values())}
    return _summary(counter, top, step.batch.num_tokens, land)


def count_mtp_step(engine: LLMEngine, top: int) -> dict:
    """Counts one whole MTP step (verify the drafts in flight, sample, draft the next):
    everything outside the layers is charged to `model`."""
    counter = LaunchCounter()
    handles = _hooks(counter, engine.model)
    try:
        with counting_triton(counter), _counting_reads(counter), counter, torch.inference_mode():
            with counter.scoped("model"):
                engine.step()
    finally:
        for h in handles:
            h.remove()
    st = engine.last_stats
    if engine.device.type == "cpu":  # the target's batch and each draft pass's, one packed copy each
        counter.launches["plan"]["copy to device"] += engine.num_spec + 1
    return _summary(counter, top, st.num_tokens) | {"drafted": st.num_drafted, "accepted": st.num_accepted}


@contextmanager
def _counting_reads(counter: LaunchCounter):
    """Each host_copy.to_host call is one wait for the device (invisible on a CPU)."""
    orig = host_copy.to_host

    def counted(*tensors):
        counter.syncs[counter.scope]["host read"] += 1
        return orig(*tensors)

    host_copy.to_host = counted
    try:
        yield
    finally:
        host_copy.to_host = orig


def _summary(counter: LaunchCounter, top: int, num_tokens: int, land: dict | None = None) -> dict:
    layers = sorted({s for s in counter.launches if s.startswith(("layer.", "mtp."))},
                    key=lambda s: (s.split(".")[0] == "mtp", int(s.split(".")[1])))
    return {
        "launches": counter.total(), "syncs": counter.total("syncs"),
        "by_scope": {s: {"launches": sum(counter.launches[s].values()), "syncs": sum(counter.syncs[s].values())}
                     for s in ["plan", *layers, "model"]} | ({"land": land} if land is not None else {}),
        "per_layer": (sum(counter.total(prefix=s) for s in layers) / len(layers)) if layers else 0.0,
        "triton_launches": sum(n for c in counter.launches.values() for op, n in c.items() if op.startswith("triton.")),
        "top_ops": counter.top(top), "sync_ops": counter.top(top, "syncs"),
        "num_tokens": num_tokens,
    }


@contextmanager
def _kernels(mode: str):
    """The kernel mode for this run only (it is read at every call)."""
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = old


def run(cfg: LaunchesBenchConfig) -> dict:
    with _kernels(cfg.kernels):
        return _run(cfg)


def _run(cfg: LaunchesBenchConfig) -> dict:
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    engine = _engine(cfg)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    decode = []
    for b in cfg.batch_sizes:
        ids = [f"d{b}-{i}" for i in range(b)]
        for rid in ids:
            fill_dummy(engine, rid, cfg.context_len, params, rng)
        decode.append({"batch": b, "context_len": cfg.context_len, **count_step(engine, cfg.top)})
        for rid in ids:
            engine.abort(rid)
    vocab = engine.model_config.vocab_size
    engine.add_request("prefill", [rng.randrange(vocab) for _ in range(cfg.prefill_len)], params)
    prefill = {"prompt_len": cfg.prefill_len, **count_step(engine, cfg.top)}
    engine.abort("prefill")
    mtp = _mtp_steps(cfg, rng) if cfg.spec_tokens else []
    return {
        "bench": "launches",
        "config": asdict(cfg),
        "model": engine.model_config.identity() | {"path": cfg.model,
                                                   "num_hidden_layers": engine.model_config.num_hidden_layers},
        "env": environment(cfg.device) | {"kernels": cfg.kernels, "triton_interpret": os.environ.get("TRITON_INTERPRET")},
        "decode": decode,
        "prefill": prefill,
        "mtp": mtp,
    }


def _mtp_steps(cfg: LaunchesBenchConfig, rng: random.Random) -> list[dict]:
    """For each batch size, a steady MTP step of B sequences: each comes with drafts, as
    from a prefill worker, and the step verifies them and drafts again."""
    engine = _engine(cfg, cfg.spec_tokens)
    if not engine.use_mtp:
        raise ValueError(f"{cfg.model}: no MTP layer to draft with")
    params = SamplingParams(max_tokens=4 + 2 * cfg.spec_tokens, temperature=0, ignore_eos=True)
    out = []
    for b in cfg.batch_sizes:
        ids = [f"m{b}-{i}" for i in range(b)]
        for rid in ids:
            fill_dummy(engine, rid, cfg.context_len, params, rng, cfg.spec_tokens)
        out.append({"batch": b, "context_len": cfg.context_len, "spec_tokens": cfg.spec_tokens,
                    **count_mtp_step(engine, cfg.top)})
        for rid in ids:
            engine.abort(rid)
    return out


def table(result: dict) -> str:
    lines = [f"{result['model']['model_type']} {result['model']['path']} · kernels={result['config']['kernels']}",
             f"{'step':>16} {'launches':>9} {'per layer':>10} {'plan':>6} {'syncs':>6}"]
    rows = [(f"decode B={d['batch']}", d) for d in result["decode"]]
    rows.append((f"prefill {result['prefill']['prompt_len']}", result["prefill"]))
    for name, d in rows:
        lines.append(f"{name:>16} {d['launches']:>9} {d['per_layer']:>10.1f} {d['by_scope']['plan']['launches']:>6} "
                     f"{d['syncs']:>6}")
    for d in result.get("mtp", []):
        lines.append(f"{'mtp B=' + str(d['batch']) + ' k=' + str(d['spec_tokens']):>16} {d['launches']:>9} "
                     f"{d['per_layer']:>10.1f} {d['by_scope']['plan']['launches']:>6} {d['syncs']:>6}")
    last = result["decode"][-1]
    lines.append(f"top ops at B={last['batch']}: " + ", ".join(f"{n} {c}" for n, c in last["top_ops"]))
    if last["sync_ops"]:
        lines.append("syncs: " + ", ".join(f"{n} {c}" for n, c in last["sync_ops"]))
    return "\n".join(lines)
