"""`moemesh bench kv-reuse`: agentic multi-turn sessions, with prefix reuse and without.

Sessions of growing context (turn 1: the initial context; each later turn appends the
model's answer and a tool output) run through a local mesh twice: once with prefix
caching, KV-aware routing and the KV store, once with caching off. Reported: the mean
time to first token of turn 1 and of turns 2 and later in each run, their ratio (the
goal: turns 2+ at least 5x faster with reuse), and the workers' prefix hit rates.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, replace

import nats

from moemesh.tools.bench.env import environment
from moemesh.tools.bench.serve import runner as serve_runner
from moemesh.tools.bench.serve import workload as wl
from moemesh.tools.bench.serve.client import ClientConfig
from moemesh.tools.launch.up import Mesh, UpConfig, default_home, ensure_tiny_model
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.protocol.messages import Heartbeat, StatsRequest, WorkerStats, decode
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.nats_io import request


@dataclass(frozen=True)
class KVReuseBenchConfig:
    model: str = ""
    sessions: int = 4
    turns: int = 4
    context_tokens: int = 0  # 0: DEFAULT_CONTEXT, or as much as the model's context leaves room for
    tool_tokens: int = 512
    osl: int = 64
    concurrency: int = 4
    prefill_workers: int = 1
    seed: int = 0


async def _worker_counters(nats_url: str) -> dict[str, dict[str, float]]:
    s = Subjects()
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe(s.heartbeat_all)
        ids: dict[str, str] = {}
        deadline = time.monotonic() + 2.5  # every worker beats within this
        while (left := deadline - time.monotonic()) > 0:
            try:
                hb = decode((await sub.next_msg(timeout=left)).data, Heartbeat)
            except Exception:  # nats' TimeoutError: the window is over
                break
            if hb.role in ("prefill", "decode", "kv_store"):
                ids[hb.worker_id] = hb.role
        await sub.unsubscribe()
        out = {}
        for wid, role in ids.items():
            st = await request(nc, s.stats(wid), StatsRequest(), WorkerStats, 10)
            out[wid] = {"role": role, **st.counters}
        return out
    finally:
        await nc.close()


DEFAULT_CONTEXT = 8192
_TEMPLATE_ROOM = 256  # the chat template's tokens around the turns


def fit_context(cfg: KVReuseBenchConfig, max_position_embeddings: int) -> KVReuseBenchConfig:
    """cfg with its first turn's context set: DEFAULT_CONTEXT, or less where the model's
    context would not hold the last turn (the tiny model holds 4096 tokens). An explicit
    context that does not fit is an error, before any mesh starts."""
    growth = cfg.turns * (cfg.tool_tokens + cfg.osl) + _TEMPLATE_ROOM
    room = max_position_embeddings - growth
    if cfg.context_tokens:
        if cfg.context_tokens > room:
            raise ValueError(f"--context-tokens {cfg.context_tokens}: the last turn would not fit the model's "
                             f"{max_position_embeddings}-token context; at most {max(room, 0)} with --turns "
                             f"{cfg.turns}, --tool-tokens {cfg.tool_tokens} and --osl {cfg.osl}")
        return cfg
    if room < 1:
        raise ValueError(f"--turns {cfg.turns} of --tool-tokens {cfg.tool_tokens} and --osl {cfg.osl} alone overflow "
                         f"the model's {max_position_embeddings}-token context")
    return replace(cfg, context_tokens=min(DEFAULT_CONTEXT, room))


def _run_once(cfg: KVReuseBenchConfig, model: str, reuse: bool) -> dict:
    ctx = cfg.context_tokens + cfg.turns * (cfg.tool_tokens + cfg.osl) + _TEMPLATE_ROOM
    sets = (f"enable_prefix_caching={str(reuse).lower()}", f"max_model_len={ctx}", "max_num_batched_tokens=2048",
            "kv_cache_memory_mb=4096", "num_speculative_tokens=0")
    up = UpConfig(model=model, port=0, num_prefill=cfg.prefill_workers, service_args=sets, kv_store=reuse,
                  kv_store_args=("capacity_mb=4096",), balancer=False,
                  # a long first turn queues behind the others' prefills for minutes on a CPU
                  gateway_args=("inactivity_timeout_s=1800",))
    work = wl.WorkloadConfig(kind="agentic", num_sessions=cfg.sessions, turns=wl.LengthDist("fixed", cfg.turns),
                             isl=wl.LengthDist("fixed", cfg.context_tokens),
                             tool_len=wl.LengthDist("fixed", cfg.tool_tokens), osl=wl.LengthDist("fixed", cfg.osl))
    with Mesh(up) as mesh:
        scfg = serve_runner.ServeBenchConfig(client=ClientConfig(url=mesh.url, endpoint="chat"), workload=work,
                                             mode="concurrency", values=(cfg.concurrency,), seed=cfg.seed,
                                             tokenizer=model, progress=False)
        summary = serve_runner.run(scfg)["points"][0]["summary"]
        counters = asyncio.run(_worker_counters(mesh.nats_url))
    pre = [c for c in counters.values() if c["role"] == "prefill"]
    prompt = sum(c.get("prompt_tokens", 0) for c in pre)
    hit = sum(c.get("prefix_cache_hit_tokens", 0) for c in pre)
    pulled = sum(c.get("kv_pulled_tokens", 0) for c in pre)
    store = next((c for c in counters.values() if c["role"] == "kv_store"), None)
    by_turn = summary.get("ttft_ms_by_turn", {})
    return {"reuse": reuse, "ttft_ms_turn1_mean": by_turn.get("1", {}).get("mean"),
            "ttft_ms_turn2plus_mean": by_turn.get("2+", {}).get("mean"), "errors": summary["num_errors"],
            "error_messages": summary.get("errors", {}).get("messages", {}),
            "prefill_prompt_tokens": prompt, "prefix_hit_tokens": hit, "pulled_tokens": pulled,
            "token_hit_rate": (hit + pulled) / prompt if prompt else None, "workers": counters,
            # what the store tier took for these hits (V4: blocks' rows and boundary snapshots)
            "store": None if store is None else {
                k: store.get(k, 0) for k in ("held_bytes_memory", "held_blocks", "held_snapshots", "blocks_hit")}}


def run(cfg: KVReuseBenchConfig) -> dict:
    model = cfg.model or str(ensure_tiny_model(default_home()))
    cfg = fit_context(cfg, ModelConfig.from_dir(model).max_position_embeddings)
    on = _run_once(cfg, model, True)
    off = _run_once(cfg, model, False)
    ratio = (off["ttft_ms_turn2plus_mean"] / on["ttft_ms_turn2plus_mean"]
             if on["ttft_ms_turn2plus_mean"] and off["ttft_ms_turn2plus_mean"] else None)
    return {"bench": "kv-reuse", "config": asdict(cfg) | {"model": model}, "env": environment(),
            "with_reuse": on, "without_reuse": off, "turn2plus_ttft_speedup": ratio, "goal_speedup": 5.0}


def table(r: dict) -> str:
    lines = [f"{'run':<14} {'TTFT turn 1 ms':>15} {'TTFT turns 2+ ms':>17} {'hit rate':>9} {'errors':>7}"]
    for name in ("with_reuse", "without_reuse"):
        x = r[name]
        rate = "-" if x["token_hit_rate"] is None else f"{x['token_hit_rate']:.1%}"
        lines.append(f"{name:<14} {x['ttft_ms_turn1_mean'] or float('nan'):>15.1f} "
                     f"{x['ttft_ms_turn2plus_mean'] or float('nan'):>17.1f} {rate:>9} {x['errors']:>7}")
    for name in ("with_reuse", "without_reuse"):
        for e in r[name].get("error_messages", []):
            lines.append(f"  {name} error x{e['count']}: {e['message']}")
    st = r["with_reuse"].get("store")
    if st:
        lines.append(f"KV store: {st['held_bytes_memory'] / 2**20:.1f} MiB in {st['held_blocks']:.0f} blocks and "
                     f"{st['held_snapshots']:.0f} snapshots; {st['blocks_hit']:.0f} blocks served")
    sp = r["turn2plus_ttft_speedup"]
    lines.append(f"turns 2+ TTFT speed-up with reuse: {sp:.1f}x (goal >= {r['goal_speedup']:.0f}x)" if sp else
                 "turns 2+ TTFT speed-up: n/a")
    return "\n".join(lines)
