"""Driving a server: warm-up, then one measured point per sweep value.

Lifecycle of a run: tokenizer loaded -> model resolved -> warm-up (discarded) -> for each
point: stream built (same shapes, fresh text) -> sessions launched by the arrival process
-> every turn of a session sent in order -> point summarised.

Arrival processes, over sessions (a single-turn workload has one request per session):
- concurrency C: a closed loop; C sessions in flight, the next starts when one ends.
- rate R: an open loop; sessions start at Poisson times of rate R (inf: all at once),
  optionally capped at --concurrency in flight. Turns of one session still run in order.
- trace X: an open loop at the trace's own times divided by X (tools/bench/serve/trace.py).
"""

from __future__ import annotations

import asyncio
import gc
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata

from moemesh.tools.bench.serve import workload as wl
from moemesh.tools.bench.serve.client import ClientConfig, ServeClient
from moemesh.tools.bench.serve.metrics import RequestRecord, by_band, prefix_cache, summarize

MODES = ("concurrency", "rate", "trace")


@dataclass(frozen=True)
class ServeBenchConfig:
    client: ClientConfig
    workload: wl.WorkloadConfig = field(default_factory=wl.WorkloadConfig)
    mode: str = "concurrency"
    values: tuple[float, ...] = (1,)  # one point per value; a sweep has several
    max_concurrency: int | None = None  # rate mode only
    warmup: int = 0
    seed: int = 0
    tokenizer: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    labels: dict = field(default_factory=dict)
    progress: bool = True
    # A moemesh server's NATS: each point adds where its requests' time went on the
    # workers (tools/bench/request_phases.py), with tracing off. "": a server of any kind.
    nats_url: str = ""
    subject_prefix: str = "mm"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be concurrency, rate or trace, got {self.mode!r}")
        if (self.mode == "trace") != (self.workload.kind == "trace"):
            raise ValueError("the trace workload replays at its own times: give --time-scale, not a rate, "
                             "concurrency or sweep")
        if self.mode == "trace" and self.client.endpoint != "completions":
            raise ValueError("a trace replays token-id prompts, which only --endpoint completions takes")
        if not self.values:
            raise ValueError("at least one concurrency or rate value is needed")
        for v in self.values:
            if self.mode == "concurrency" and (v < 1 or v != int(v)):
                raise ValueError(f"a concurrency must be a positive integer, got {v:g}")
            if self.mode == "rate" and not v > 0:
                raise ValueError(f"a rate must be positive (or inf), got {v:g}")
            if self.mode == "trace" and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"--time-scale must be a positive number, got {v:g}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")


class Progress:
    """A one-line bar on stderr; off a terminal, a line per tenth so logs stay short."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None):
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.done = self.errors = self._last_tenth = 0
        self.t0 = time.monotonic()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        tenth = self.done * 10 // max(self.total, 1)
        if self.enabled and (self.tty or tenth > self._last_tenth or self.done == self.total):
            self._last_tenth = tenth
            filled = self.done * 30 // max(self.total, 1)
            line = (f"{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                    f"err={self.errors} {time.monotonic() - self.t0:.1f}s")
            self.stream.write(("\r" + line) if self.tty else line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


async def run_session(client: ServeClient, spec: wl.SessionSpec, first_index: int,
                      records: list[RequestRecord], progress: Progress | None = None) -> None:
    """Send a session's turns in order, each on the context the previous turns left.
    A failed turn leaves an empty answer and the session carries on, so every point sends
    the same number of requests."""
    messages: list[dict] = []
    answer, context_target = "", 0
    for k, turn in enumerate(spec.turns):
        if k == 0:
            messages = [{"role": "user", "content": turn.text}]
        else:
            messages = wl.context_after(messages, answer, turn)
        context_target += turn.input_len
        rec = RequestRecord(index=first_index + k, session=spec.session, turn=k + 1,
                            max_tokens=turn.max_tokens, target_input_tokens=context_target, group=spec.group,
                            trace_input_tokens=turn.trace_input_len, priority=spec.priority)
        await client.send(rec, messages, turn.prompt_ids)
        records.append(rec)
        if progress is not None:
            progress.update(rec.ok)
        answer = rec.text
        context_target += rec.output_tokens


@contextmanager
def no_full_collections():
    """The client's collector never walks everything during a point: at 1,500 requests one
    such walk (every record and connection so far) paused all the streams the client read
    for 100-110 ms, which the point's TTFT p99 then counted as the server's. Young
    collections go on; what the point left behind is collected after it."""
    gc.collect()
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()


async def run_point(client: ServeClient, work: wl.Workload, mode: str, value: float,
                    max_concurrency: int | None = None, progress: Progress | None = None) -> list[RequestRecord]:
    """Run one point's stream; records come back in request-index order, times in seconds
    from the point's start."""
    with no_full_collections():
        return await _run_point(client, work, mode, value, max_concurrency, progress)


async def _run_point(client: ServeClient, work: wl.Workload, mode: str, value: float,
                     max_concurrency: int | None, progress: Progress | None) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    firsts, n = [], 0
    for s in work.sessions:
        firsts.append(n)
        n += len(s.turns)
    jobs = list(zip(work.sessions, firsts))
    client.reset_clock()
    if mode == "concurrency":
        it = iter(jobs)

        async def loop() -> None:
            for spec, first in it:  # shared iterator: each worker takes the next session
                await run_session(client, spec, first, records, progress)

        await asyncio.gather(*(loop() for _ in range(min(int(value), len(jobs)))))
    else:
        cap = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def capped(spec: wl.SessionSpec, first: int) -> None:
            if cap is None:
                return await run_session(client, spec, first, records, progress)
            async with cap:
                await run_session(client, spec, first, records, progress)

        tasks = []
        for (spec, first), at in zip(jobs, work.arrivals):
            delay = at / value - client.now() if math.isfinite(value) else 0.0
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(capped(spec, first)))
        await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r.index)


def warmup_workload(cfg: ServeBenchConfig, tokenizer=None, max_model_len: int | None = None) -> wl.Workload:
    """N single requests shaped like the first turns of the real stream, with their own text."""
    base = wl.build(cfg.workload, cfg.seed, salt="warmup", tokenizer=tokenizer, max_model_len=max_model_len)
    sessions = tuple(wl.SessionSpec(i, base.sessions[i % len(base.sessions)].turns[:1])
                     for i in range(cfg.warmup))
    return wl.Workload(sessions, tuple(0.0 for _ in sessions))


async def run_async(cfg: ServeBenchConfig) -> dict:
    from moemesh.tools.bench.env import environment

    tok = wl.load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    async with ServeClient(cfg.client) as client:
        model = await client.resolve_model()
        warm = {"num_requests": cfg.warmup, "num_errors": 0}
        if cfg.warmup:
            work = warmup_workload(cfg, tok, client.max_model_len)
            conc = int(cfg.values[0]) if cfg.mode == "concurrency" else (cfg.max_concurrency or 8)
            bar = Progress(work.num_requests, "warm-up", cfg.progress)
            recs = await run_point(client, work, "concurrency", min(conc, cfg.warmup), progress=bar)
            bar.close()
            warm["num_errors"] = sum(not r.ok for r in recs)
        points = []
        for i, value in enumerate(cfg.values):
            work = wl.build(cfg.workload, cfg.seed, salt=i, tokenizer=tok, max_model_len=client.max_model_len)
            over = wl.over_context(work, client.max_model_len)
            if over:
                print(f"warning: {over} of {work.num_requests} requests will not fit the server's "
                      f"{client.max_model_len}-token context (prompt plus max_tokens"
                      f"{'; each agentic turn resends the session so far' if cfg.workload.kind == 'agentic' else ''})"
                      f": they will fail", file=sys.stderr)
            bar = Progress(work.num_requests, f"{cfg.mode}={value:g}", cfg.progress)
            t0 = time.time()
            recs = await run_point(client, work, cfg.mode, value, cfg.max_concurrency, bar)
            t1 = time.time()
            bar.close()
            summary = summarize(recs, cfg.slo_ttft_ms, cfg.slo_tpot_ms)
            points.append({"mode": cfg.mode, "value": value, "text_salt": i, "over_context_requests": over,
                           "summary": summary,
                           **({"trace": trace_figures(work.trace, value, recs)} if work.trace else {}),
                           **({"server_phases": await _server_phases(cfg, t0, t1)} if cfg.nats_url else {}),
                           "requests": [r.to_json() for r in recs]})
    return {
        "bench": "serve",
        "schema_version": 1,
        "config": config_json(cfg) | {"model": model, "server_max_model_len": client.max_model_len},
        "seeds": {"seed": cfg.seed, "warmup_text_salt": "warmup",
                  "points": [{"value": p["value"], "text_salt": p["text_salt"]} for p in points]},
        "env": environment() | {"versions": _versions()},
        "warmup": warm,
        "points": points,
    }


def trace_figures(info: dict, time_scale: float, records: list[RequestRecord]) -> dict:
    """What the trace implies beside what the server did: the prefix hit rate and TTFT/ITL
    by the trace's context-length band."""
    from moemesh.tools.bench.serve import trace as tr

    ok = [r for r in records if r.ok]
    bands = by_band(ok, lambda r: tr.band(r.trace_input_tokens or r.target_input_tokens), tr.band_order())
    return info | {"time_scale": time_scale, "achieved": prefix_cache(ok), "by_band": bands}


async def _server_phases(cfg: ServeBenchConfig, t0: float, t1: float) -> dict:
    """The workers' phase figures over [t0, t1]; {"error": why} when they cannot be had
    (the load's own figures stand either way)."""
    from moemesh.tools.bench import request_phases

    try:
        workers = await request_phases.live_workers(cfg.nats_url, cfg.subject_prefix)
        return request_phases.figures(await request_phases.fetch(cfg.nats_url, workers, cfg.subject_prefix), t0, t1)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def run(cfg: ServeBenchConfig) -> dict:
    return asyncio.run(run_async(cfg))


def config_json(cfg: ServeBenchConfig) -> dict:
    c = cfg.client
    return {
        "url": c.url, "endpoint": c.endpoint, "model": c.model, "ignore_eos": c.ignore_eos,
        "stream_usage": c.stream_usage, "timeout_s": c.timeout_s, "worker_header": c.worker_header,
        "temperature": c.temperature, "extra_body": c.extra_body, "api_key_set": c.api_key is not None,
        "workload": cfg.workload.description, "mode": cfg.mode, "values": list(cfg.values),
        "max_concurrency": cfg.max_concurrency, "warmup": cfg.warmup, "seed": cfg.seed,
        "tokenizer": cfg.tokenizer, "slo_ttft_ms": cfg.slo_ttft_ms, "slo_tpot_ms": cfg.slo_tpot_ms,
        "labels": dict(cfg.labels), "nats_url": cfg.nats_url,
    }


def _versions() -> dict:
    out = {}
    for pkg in ("httpx", "tokenizers", "matplotlib", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out
