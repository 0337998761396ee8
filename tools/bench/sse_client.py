"""A streaming load client in its own process, cheap enough never to be the limit.

    python -m moemesh.tools.bench.sse_client --url http://127.0.0.1:8000 --streams 64 --seconds 20 \
        --max-tokens 256 --model tiny [--chat] [--cpu-pids gateway=PID,decode-0=PID]

Each of N streams holds one keep-alive HTTP/1.1 connection and sends streamed OpenAI
requests on it back to back (max_tokens = min_tokens = M, ignore_eos) until T seconds
have passed; the request in flight then finishes, so every stream sends at least one.

Lifecycle of one request: written -> head read -> non-200: body read and dropped, an
error | 200: the chunked body read in bulk, SSE events counted (`moemesh.tools.bench.sse_wire`)
-> last chunk: complete if the body ends in `data: [DONE]`, else an error
(`stream_incomplete`). A connection
error, a malformed reply or a read timeout is an error too; the connection is then
closed and the next request opens a new one after a short back-off.

Tokens: the server sends one event per token, a separate finish event and `data: [DONE]`,
so a complete request's tokens are its events - 2. Events are counted, not parsed: no JSON
on the hot path. TTFT is request written -> first complete event.

Prints one JSON line at the end: tokens, requests (complete ones), errors and their
kinds, wall seconds (first request to last stream done), tokens/s, TTFT p50/p99 ms, the
client's own CPU seconds (getrusage) and, with --cpu-pids, the CPU seconds of each named
process tree over exactly the load window (`moemesh.tools.bench.proc_cpu`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from moemesh.tools.bench.env import percentile
from moemesh.tools.bench.proc_cpu import tree_cpu_seconds
from moemesh.tools.bench.sse_wire import ChunkedSSE, ProtocolError

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)")
_READ = 1 << 16
_BACKOFF_S = 0.05


@dataclass(frozen=True)
class LoadConfig:
    url: str  # the server's base URL, or a full endpoint URL
    model: str
    streams: int = 8
    seconds: float = 10.0
    max_tokens: int = 256
    chat: bool = False
    prompt_tokens: int = 0  # completions only: a prompt of this many token ids instead of text
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0  # a reply whose reads stall for (half of) this is an error
    cpu_pids: dict = field(default_factory=dict)  # name -> pid, measured over the load window

    def request_bytes(self) -> tuple[str, int, bytes]:
        """(host, port, the whole HTTP request, sent as is for every request)."""
        u = urlsplit(self.url)
        if u.scheme != "http":
            raise ValueError(f"only http:// URLs are supported, got {self.url!r}")
        path = u.path.rstrip("/")
        if path in ("", "/v1"):
            path = "/v1/chat/completions" if self.chat else "/v1/completions"
        body = {"model": self.model, "stream": True, "max_tokens": self.max_tokens, "min_tokens": self.max_tokens,
                "ignore_eos": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": "hello there " * 8}]
        elif self.prompt_tokens:
            body["prompt"] = [10 + i % 90 for i in range(self.prompt_tokens)]
        else:
            body["prompt"] = "hello there " * 8
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
        return u.hostname or "127.0.0.1", u.port or 80, head + payload


class _Tally:
    def __init__(self) -> None:
        self.tokens = 0
        self.requests = 0
        self.errors: Counter[str] = Counter()
        self.ttft: list[float] = []


async def run_load(cfg: LoadConfig) -> dict:
    """N streams for T seconds against cfg.url; the result line as a dict."""
    host, port, req = cfg.request_bytes()
    tally = _Tally()
    loop = asyncio.get_running_loop()
    cpu0 = tree_cpu_seconds(cfg.cpu_pids) if cfg.cpu_pids else {}
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    # loop.time() is the deadline clock; uvloop's has millisecond steps, so times are taken with perf_counter.
    started_at, t0 = time.time(), time.perf_counter()
    deadline = loop.time() + cfg.seconds
    await asyncio.gather(*(_stream(cfg, host, port, req, deadline, tally) for _ in range(cfg.streams)))
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu1 = tree_cpu_seconds(cfg.cpu_pids) if cfg.cpu_pids else {}
    ttft = [x * 1e3 for x in tally.ttft]
    return {"streams": cfg.streams, "seconds": cfg.seconds, "max_tokens": cfg.max_tokens, "tokens": tally.tokens,
            "requests": tally.requests, "errors": sum(tally.errors.values()),
            "error_kinds": dict(tally.errors.most_common(5)), "wall_s": wall,
            "tokens_per_s": tally.tokens / wall if wall > 0 else 0.0,
            "ttft_ms_p50": percentile(ttft, 50) if ttft else None,
            "ttft_ms_p99": percentile(ttft, 99) if ttft else None,
            "client_cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime),
            "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0}, "started_at": started_at, "ended_at": time.time()}


async def _stream(cfg: LoadConfig, host: str, port: int, req: bytes, deadline: float, tally: _Tally) -> None:
    loop = asyncio.get_running_loop()
    reader = writer = None
    while True:
        try:
            if writer is None:
                async with asyncio.timeout(cfg.connect_timeout_s):
                    reader, writer = await asyncio.open_connection(host, port)
            if not await _request(cfg, reader, writer, req, tally):
                writer.close()
                writer = None
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ProtocolError,
                TimeoutError) as e:
            tally.errors[_kind(e)] += 1
            if writer is not None:
                writer.close()
                writer = None
            if loop.time() < deadline:
                await asyncio.sleep(_BACKOFF_S)  # a refused or broken server must not be hammered
        if loop.time() >= deadline:
            break
    if writer is not None:
        writer.close()


async def _request(cfg: LoadConfig, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes,
                   tally: _Tally) -> bool:
    """One request on an open connection; tallies it. Returns whether the connection stays open."""
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    writer.write(req)
    async with asyncio.timeout(cfg.read_timeout_s) as tm:
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.") or len(head) < 12:
            raise ProtocolError("not an HTTP/1.x reply")
        status, low = int(head[9:12]), head.lower()
        keep = b"\r\nconnection: close" not in low
        if b"\r\ntransfer-encoding: chunked" not in low:
            m = _CONTENT_LENGTH.search(low)
            if m is None:
                await reader.read()  # delimited by the connection closing
                keep = False
            else:
                await reader.readexactly(int(m.group(1)))
            tally.errors[f"http_{status}" if status != 200 else "not_chunked"] += 1
            return keep
        body, first = ChunkedSSE(), True
        # The timer is moved on only once half of it has passed (a read stalled for half to all
        # of read_timeout_s is an error): moving it on every read would cost as much as a parse.
        half = cfg.read_timeout_s / 2
        renew_at = loop.time() + half
        while not body.done:
            data = await reader.read(_READ)
            if not data:
                raise EOFError("connection closed mid-reply")
            body.feed(data)
            if first and body.events:
                first = False
                ttft = time.perf_counter() - t0
            now = loop.time()
            if now > renew_at:
                tm.reschedule(now + cfg.read_timeout_s)
                renew_at = now + half
    if status != 200:
        tally.errors[f"http_{status}"] += 1
    elif not body.complete:
        tally.errors["stream_incomplete"] += 1  # an error event, or no [DONE]
    else:
        tally.requests += 1
        tally.tokens += max(body.events - 2, 0)
        tally.ttft.append(ttft)
    return keep


def _kind(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, ProtocolError):
        return "protocol"
    if isinstance(e, ConnectionRefusedError):
        return "connect_refused"
    if isinstance(e, (ConnectionError, EOFError, asyncio.IncompleteReadError)):
        return "connection_closed"
    return type(e).__name__


def _pids(s: str) -> dict[str, int]:
    out = {}
    for item in filter(None, s.split(",")):
        name, _, pid = item.rpartition("=")
        out[name or pid] = int(pid)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moemesh.tools.bench.sse_client", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="base URL (http://host:port) or a full endpoint URL")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--model", required=True)
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions (default /v1/completions)")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="completions: a prompt of this many token ids (default: a short text prompt)")
    p.add_argument("--cpu-pids", type=_pids, default={}, help="name=pid,...: CPU of these trees over the load")
    p.add_argument("--read-timeout", type=float, default=60.0)
    a = p.parse_args(argv)
    if a.streams < 1 or a.seconds < 0 or a.max_tokens < 1:
        p.error("--streams and --max-tokens must be >= 1, --seconds >= 0")
    cfg = LoadConfig(url=a.url, model=a.model, streams=a.streams, seconds=a.seconds, max_tokens=a.max_tokens,
                     chat=a.chat, prompt_tokens=a.prompt_tokens, read_timeout_s=a.read_timeout, cpu_pids=a.cpu_pids)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run_load(cfg))
    else:
        result = uvloop.run(run_load(cfg))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
