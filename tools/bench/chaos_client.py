"""The chaos bench's load client, in its own process so that the gateway's CPU is not
shared with it (`moemesh bench chaos` starts it; see tools/bench/chaos.py).

    python -m moemesh.tools.bench.chaos_client '<ChaosLoad as JSON>'

Lifecycle:
1. sending: every stream's request goes out at once, each on its own connection,
   streams spread over the gateways in turn; then `{"event": "sent"}` on stdout.
2. streaming: once every stream has `ready_tokens` tokens (or has ended),
   `{"event": "streaming"}`. The runner now injects its fault.
3. fault: the runner writes `fault <unix time> <deadline unix time>` on stdin. From
   then, probes (short requests, open loop, `probe_rate` a second for `probe_s`) go to
   the last gateway: new work arriving while the mesh recovers. (A runner may write the
   line ahead of the fault's time, so that some probes come before it.)
   With `probe_turns = 2` each probe is the second turn of a conversation whose first
   turn ran before the streams were sent: its prompt is that turn's prompt, the answer's
   token ids and a few more, so its prefill finds most of the prompt held elsewhere (the
   KV store, the decode worker that answered) and fetches it.
4. done: every stream and probe has ended, or the deadline has passed (what is left
   is cancelled and counted as hung). One `{"event": "result", ...}` line.

Per stream it records what a careful client would check: the HTTP status, each token
event (a chunk without a finish reason), the finish reason or error event, whether
`data: [DONE]` came, a digest of the text (at temperature 0 on the mock engine every
stream's text is the same), time to the first token and the longest gap between two
events after it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import queue
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import orjson

START_DEADLINE_S = 300.0  # the runner never sent its fault (it died): give up after this


@dataclass(frozen=True)
class ChaosLoad:
    urls: list[str]  # gateway base URLs; stream i goes to urls[i % len(urls)]
    model: str
    streams: int = 100
    max_tokens: int = 200
    prompt_tokens: int = 64
    ready_tokens: int = 20  # tokens every stream has before the runner is told to strike
    probe_rate: float = 5.0  # probes a second after the fault (0: none)
    probe_s: float = 5.0
    probe_tokens: int = 8
    probe_turns: int = 1  # 2: each probe is a conversation's second turn (see above)
    first_turn_tokens: int = 40  # probe_turns = 2: the first turn's answer; blocks past the prompt's

    def __post_init__(self) -> None:
        if self.probe_turns not in (1, 2):
            raise ValueError("probe_turns must be 1 or 2")


@dataclass
class StreamRecord:
    i: int
    gateway: int  # index into urls
    status: int = 0
    tokens: int = 0  # token events: chunks without a finish reason
    finish: str | None = None
    error: str | None = None  # an error event, a refused request or a broken connection
    done: bool = False  # `data: [DONE]` arrived
    hung: bool = False  # still open at the deadline
    text_sha1: str = ""
    t_sent: float = 0.0  # unix time
    t_first: float | None = None
    t_end: float | None = None
    max_gap_s: float = 0.0  # longest silence between two events after the first
    gap_end: float | None = None  # unix time that silence ended
    worker: str | None = None  # the x-moemesh-worker header, where the gateway sends one
    _text: list[str] = field(default_factory=list, repr=False)

    def out(self) -> dict:
        d = asdict(self)
        d.pop("_text")
        return d


def prompt_ids(i: int, n: int) -> list[int]:
    """Stream i's prompt: n ids of its own (no two streams share a cached prefix, so routing
    does not herd them onto one worker), always n long (so the mock engine, whose tokens
    depend on the position only, gives every stream the same answer)."""
    return [10 + (i * 31 + j * 7) % 200 for j in range(n)]


def _event(name: str, **kw) -> None:
    print(json.dumps({"event": name, **kw}), flush=True)


async def _stream(c: httpx.AsyncClient, url: str, body: dict, rec: StreamRecord, ready: int,
                  progress: asyncio.Event) -> None:
    rec.t_sent = time.time()
    last = None
    try:
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            rec.status = r.status_code
            rec.worker = r.headers.get("x-moemesh-worker")
            if r.status_code != 200:
                rec.error = f"http_{r.status_code}"
                await r.aread()
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.time()
                if last is None:
                    rec.t_first = now
                elif now - last > rec.max_gap_s:
                    rec.max_gap_s, rec.gap_end = now - last, now
                last = now
                data = line[6:]
                if data == "[DONE]":
                    rec.done = True
                    continue
                ev = orjson.loads(data)
                if "error" in ev:
                    rec.error = "error_event"
                    continue
                choice = ev["choices"][0]
                rec._text.append(choice.get("text") or "")
                if choice.get("finish_reason") is None:
                    rec.tokens += 1
                    if rec.tokens == ready:
                        progress.set()
                else:
                    rec.finish = choice["finish_reason"]
    except httpx.HTTPError as e:
        rec.error = f"connection: {type(e).__name__}"
    except asyncio.CancelledError:
        rec.hung = True
        now = time.time()
        if now - (last or rec.t_sent) > rec.max_gap_s:  # its silence up to the deadline is a stall too
            rec.max_gap_s, rec.gap_end = now - (last or rec.t_sent), now
        raise
    finally:
        rec.t_end = time.time()
        rec.text_sha1 = hashlib.sha1("".join(rec._text).encode()).hexdigest()
        progress.set()


async def _probe(c: httpx.AsyncClient, url: str, body: dict, out: list[dict]) -> None:
    """One short streamed request; its x-moemesh-worker header names the decode worker the
    gateway chose for it."""
    rec = {"t_sent": time.time(), "status": 0, "error": None, "latency_s": None, "ttft_s": None, "worker": None}
    out.append(rec)
    try:
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            rec["status"], rec["worker"] = r.status_code, r.headers.get("x-moemesh-worker")
            if r.status_code != 200:
                rec["error"] = f"http_{r.status_code}"
            done = False
            async for line in r.aiter_lines():
                if line.startswith('data: {"error"'):
                    rec["error"] = "error_event"
                elif rec["ttft_s"] is None and line.startswith("data: {"):
                    rec["ttft_s"] = time.time() - rec["t_sent"]
                done = done or line == "data: [DONE]"
            if rec["error"] is None and not done:
                rec["error"] = "no [DONE]"
    except httpx.HTTPError as e:
        rec["error"] = f"connection: {type(e).__name__}"
    except asyncio.CancelledError:
        rec["error"] = "hung"
        raise
    finally:
        rec["latency_s"] = time.time() - rec["t_sent"]


def _num_probes(cfg: ChaosLoad) -> int:
    return int(cfg.probe_rate * cfg.probe_s) if cfg.probe_rate > 0 else 0


async def _first_turns(c: httpx.AsyncClient, cfg: ChaosLoad) -> list[list[int]]:
    """probe_turns = 2: every probe's first turn, run to its end now; returns each probe's
    second-turn prompt (the first turn's prompt, its answer's ids, 16 ids more)."""
    async def turn(k: int) -> list[int]:
        first = prompt_ids(200_000 + k, cfg.prompt_tokens)
        r = await c.post(cfg.urls[-1] + "/v1/completions", json={
            "model": cfg.model, "prompt": first, "max_tokens": cfg.first_turn_tokens,
            "min_tokens": cfg.first_turn_tokens, "ignore_eos": True, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True})
        r.raise_for_status()
        answer = [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
        return first + answer + prompt_ids(300_000 + k, 16)

    return list(await asyncio.gather(*(turn(k) for k in range(_num_probes(cfg)))))


async def _probes(c: httpx.AsyncClient, cfg: ChaosLoad, prompts: list[list[int]], out: list[dict],
                  tasks: list[asyncio.Task]) -> None:
    body = {"model": cfg.model, "stream": True, "max_tokens": cfg.probe_tokens, "min_tokens": cfg.probe_tokens,
            "ignore_eos": True, "temperature": 0}
    t0 = time.monotonic()
    for k in range(_num_probes(cfg)):
        await asyncio.sleep(max(0.0, t0 + k / cfg.probe_rate - time.monotonic()))
        b = {**body, "prompt": prompts[k] if prompts else prompt_ids(100_000 + k, 16)}
        tasks.append(asyncio.create_task(_probe(c, cfg.urls[-1], b, out)))


async def run(cfg: ChaosLoad) -> dict:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    # No read timeout: a stall is what is measured, and the deadline ends what never ends.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.streams)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as c:
        second_turns = await _first_turns(c, cfg) if cfg.probe_turns == 2 else []
        recs = [StreamRecord(i, i % len(cfg.urls)) for i in range(cfg.streams)]
        progress = asyncio.Event()
        streams = []
        for rec in recs:
            body = {"model": cfg.model, "prompt": prompt_ids(rec.i, cfg.prompt_tokens), "stream": True,
                    "max_tokens": cfg.max_tokens, "min_tokens": cfg.max_tokens, "ignore_eos": True,
                    "temperature": 0}
            streams.append(asyncio.create_task(_stream(c, cfg.urls[rec.gateway], body, rec, cfg.ready_tokens,
                                                       progress)))
        _event("sent", t=time.time())
        fault = asyncio.create_task(stdin.readline())
        while not fault.done() and any(r.tokens < cfg.ready_tokens and r.t_end is None for r in recs):
            progress.clear()
            woke = asyncio.create_task(progress.wait())
            await asyncio.wait([fault, woke], timeout=START_DEADLINE_S, return_when=asyncio.FIRST_COMPLETED)
            woke.cancel()
        _event("streaming", t=time.time())
        done, _ = await asyncio.wait([fault], timeout=START_DEADLINE_S)
        fault.cancel()
        words = fault.result().split() if done else []
        fault_at, deadline = (float(words[1]), float(words[2])) if len(words) == 3 else (None, time.time())
        probes: list[dict] = []
        probe_tasks: list[asyncio.Task] = []
        sender = asyncio.create_task(_probes(c, cfg, second_turns, probes, probe_tasks)) if fault_at else None
        if sender is not None:
            await asyncio.wait([sender], timeout=max(0.0, deadline - time.time()))
            sender.cancel()
        pending = streams + probe_tasks
        _, left = await asyncio.wait(pending, timeout=max(0.0, deadline - time.time()))
        for t in left:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return {"event": "result", "config": asdict(cfg), "fault_at": fault_at, "deadline": deadline,
            "streams": [r.out() for r in recs], "probes": probes}


# ---- the runner's side -------------------------------------------------------------------------
class LoadClient:
    """This client as the runner's child process: its event lines read on a thread, the
    fault written to its stdin."""

    def __init__(self, load: ChaosLoad, log_path: Path):
        self._load, self._log_path = load, log_path
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "LoadClient":
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moemesh.tools.bench.chaos_client", json.dumps(asdict(self._load))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(10)

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout_s: float) -> dict:
        try:
            line = self._lines.get(timeout=max(0.1, timeout_s))
        except queue.Empty:
            raise TimeoutError(f"the load client said nothing for {timeout_s:.0f}s; see {self._log_path}") from None
        if line is None:
            raise RuntimeError(f"the load client exited (code {self._proc.wait()}); see {self._log_path}")
        return json.loads(line)

    def wait(self, event: str, timeout_s: float = 120.0) -> dict:
        """Until the client prints `event` (events before it are passed over)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ev = self._next(deadline - time.monotonic())
            if ev["event"] == event:
                return ev

    def fault(self, at: float, deadline: float) -> None:
        self._proc.stdin.write(f"fault {at} {deadline}\n")
        self._proc.stdin.flush()

    def result(self, timeout_s: float) -> dict:
        return self.wait("result", timeout_s)


def client_main(argv: list[str] | None, module: str, load_cls: type, run_load) -> int:
    """A load client's main: its load (load_cls) as JSON in the one argument, run_load(load)
    on uvloop, and the result as one JSON line on stdout."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {module} '<{load_cls.__name__} JSON>'", file=sys.stderr)
        return 2
    cfg = load_cls(**json.loads(args[0]))
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run_load(cfg))
    else:
        result = uvloop.run(run_load(cfg))
    print(json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return client_main(argv, "moemesh.tools.bench.chaos_client", ChaosLoad, run)


if __name__ == "__main__":
    sys.exit(main())
