"""`moemesh bench stream`: the serving path alone (gateway + NATS + decode), with the
mock engine, at high concurrency.

Workers run `engine = "mock"`: no model compute, a fixed step time, one token per
sequence per step. Many concurrent SSE streams run for a fixed time. Reported: output
tokens/s relayed to clients, and the gateway's CPU time per output token (from
/proc/<pid>/stat before and after), which is what the streaming path costs.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from shared.bench.env import environment
from shared.launch.up import Mesh, UpConfig


@dataclass(frozen=True)
class StreamBenchConfig:
    model: str = ""
    streams: int = 256
    seconds: float = 20.0
    osl: int = 256
    mock_step_ms: float = 2.0
    prompt_words: int = 16


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _client(url: str, model: str, cfg: StreamBenchConfig, deadline: float, counts: list[int],
                  errors: list[str]) -> None:
    body = {"model": model, "prompt": " ".join(["token"] * cfg.prompt_words), "max_tokens": cfg.osl,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=120) as c:
        while time.monotonic() < deadline:
            try:
                async with c.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}")
                        await asyncio.sleep(0.05)
                        continue
                    tail = b""
                    async for chunk in r.aiter_raw():  # no per-chunk parsing: the client must not be the limit
                        tail = (tail + chunk)[-512:]
                    usage = tail.rsplit(b'"usage":', 1)
                    if len(usage) == 2:
                        counts.append(json.loads(usage[1].split(b"}", 1)[0] + b"}")["completion_tokens"])
            except httpx.HTTPError as e:
                errors.append(type(e).__name__)


async def _drive(url: str, model: str, cfg: StreamBenchConfig) -> tuple[list[int], list[str], float]:
    counts: list[int] = []
    errors: list[str] = []
    t0 = time.monotonic()
    deadline = t0 + cfg.seconds
    await asyncio.gather(*(_client(url, model, cfg, deadline, counts, errors) for _ in range(cfg.streams)))
    return counts, errors, time.monotonic() - t0


def run(cfg: StreamBenchConfig) -> dict:
    sets = ("engine=mock", f"mock_step_ms={cfg.mock_step_ms}", f"max_num_seqs={max(cfg.streams, 64)}",
            f"max_num_batched_tokens={max(cfg.streams * 32, 2048)}", "num_kv_blocks=16384")
    up = UpConfig(model=cfg.model, port=0, service_args=sets, gateway_args=(f"max_inflight={cfg.streams * 2}",),
                  balancer=False)
    with Mesh(up) as mesh:
        procs = {c.name: c.popen.pid for c in mesh.group.children}
        before = {n: cpu_seconds(p) for n, p in procs.items() if n != "nats"}
        counts, errors, elapsed = asyncio.run(_drive(mesh.url, Path(mesh.model).name, cfg))
        after = {n: cpu_seconds(p) for n, p in procs.items() if n != "nats"}
    tokens = sum(counts)
    cpu = {n: after[n] - before[n] for n in before}
    return {
        "bench": "stream", "config": asdict(cfg), "env": environment(), "elapsed_s": elapsed,
        "requests": len(counts), "errors": len(errors), "error_kinds": sorted(set(errors))[:10],
        "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "cpu_seconds": cpu,
        "gateway_cpu_us_per_token": cpu.get("gateway", 0.0) / tokens * 1e6 if tokens else None,
        "goal": {"output_tokens_per_s": 60000, "gateway_cpu_us_per_token": 25},
    }


def table(r: dict) -> str:
    lines = [f"streams {r['config']['streams']}, {r['elapsed_s']:.1f}s, mock step {r['config']['mock_step_ms']} ms",
             f"output tokens/s: {r['output_tokens_per_s']:.0f}   (goal {r['goal']['output_tokens_per_s']})",
             f"gateway CPU per token: {r['gateway_cpu_us_per_token'] or float('nan'):.1f} us   "
             f"(goal <= {r['goal']['gateway_cpu_us_per_token']})",
             f"requests {r['requests']}, errors {r['errors']} {r['error_kinds']}",
             "CPU seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_seconds"].items())]
    return "\n".join(lines)
