"""The load client of the host-overhead benchmarks: chunked SSE parsing, and run against a
scripted in-process HTTP server (asyncio.start_server)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from moemesh.tools.bench.sse_client import LoadConfig, run_load
from moemesh.tools.bench.sse_wire import ChunkedSSE, ProtocolError

TOKENS = 5
EVENTS = [b'data: {"choices":[{"text":"t%d"}]}\n\n' % i for i in range(TOKENS)]
EVENTS += [b'data: {"choices":[{"text":"","finish_reason":"length"}]}\n\n', b"data: [DONE]\n\n"]
BODY = b"".join(EVENTS)
OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"


def chunked(body: bytes, cuts: list[int]) -> bytes:
    """`body` in HTTP chunks cut at the given offsets, then the last chunk."""
    edges = [0, *cuts, len(body)]
    pieces = [body[a:b] for a, b in zip(edges, edges[1:]) if b > a]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


# Chunk boundaries between an event's two newlines, inside `data: [DONE]`, and mid-JSON.
CUTS = [len(EVENTS[0]) - 1, len(EVENTS[0]) + 9, len(BODY) - 6]
OK = OK_HEAD + chunked(BODY, CUTS)
ERROR_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: 22\r\n\r\n"
             b'{"error": "too busy!"}')
ERROR_500_CHUNKED = (b"HTTP/1.1 500 Internal Server Error\r\ntransfer-encoding: chunked\r\n\r\n"
                     + chunked(b'{"error": "boom"}', [5]))
NO_DONE = OK_HEAD + chunked(b"".join(EVENTS[:-1]), [7])  # ends cleanly, but without [DONE]
CUT_OFF = OK_HEAD + chunked(BODY, CUTS)[:40]  # the connection closes mid-body
SILENT = b""  # never replies


def test_parser_counts_events_however_the_bytes_arrive():
    raw = chunked(BODY, CUTS)
    splits = [[raw], [raw[i:i + 1] for i in range(len(raw))]] + [[raw[:i], raw[i:]] for i in range(1, len(raw))]
    for parts in splits:
        p = ChunkedSSE()
        for part in parts:
            p.feed(part)
        assert (p.events, p.done, p.complete) == (len(EVENTS), True, True)


def test_parser_is_not_done_before_the_last_chunk_and_needs_done():
    raw = chunked(BODY, CUTS)
    p = ChunkedSSE()
    p.feed(raw[:-5])
    assert not p.done and not p.complete
    p = ChunkedSSE()
    p.feed(chunked(b"".join(EVENTS[:-1]), [3]))
    assert p.done and not p.complete and p.events == len(EVENTS) - 1


@pytest.mark.parametrize("raw", [b"zz\r\nab\r\n", b"2\r\nabcd\r\n", b"f" * 2000])
def test_parser_rejects_bad_framing(raw):
    with pytest.raises(ProtocolError):
        ChunkedSSE().feed(raw)


class Scripted:
    """An HTTP/1.1 server that answers each request with the next scripted reply (`default`
    once the script is used up), over keep-alive connections."""

    def __init__(self, replies: list[bytes], default: bytes = ERROR_503):
        self.replies, self.default = list(replies), default
        self.requests: list[tuple[bytes, dict]] = []
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
                self.requests.append((head, json.loads(await reader.readexactly(n))))
                reply = self.replies.pop(0) if self.replies else self.default
                if reply is SILENT:
                    await reader.read()  # until the client gives up
                    return
                writer.write(reply)
                await writer.drain()
                if reply is CUT_OFF:
                    return
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


def load(server: Scripted, **kw) -> dict:
    async def go() -> dict:
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            return await run_load(LoadConfig(url=f"http://127.0.0.1:{port}", model="tiny", **kw))
        finally:
            srv.close()

    return asyncio.run(go())


def test_counts_tokens_requests_and_http_errors():
    # --seconds 0: every stream sends exactly one request.
    server = Scripted([OK, ERROR_503, OK])
    r = load(server, streams=3, seconds=0, max_tokens=7, chat=True)
    assert (r["tokens"], r["requests"], r["errors"], r["error_kinds"]) == (2 * TOKENS, 2, 1, {"http_503": 1})
    assert r["ttft_ms_p50"] is not None and r["client_cpu_s"] >= 0 and r["cpu_s"] == {}
    head, body = server.requests[0]
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == body["min_tokens"] == 7
    assert body["messages"] == [{"role": "user", "content": "hello there " * 8}]


def test_one_keep_alive_connection_per_stream_through_errors():
    server = Scripted([OK, ERROR_500_CHUNKED, ERROR_503], default=OK)
    r = load(server, streams=1, seconds=0.3, max_tokens=5, prompt_tokens=12)
    assert r["errors"] == 2 and r["error_kinds"] == {"http_500": 1, "http_503": 1}
    assert r["requests"] >= 1 and r["tokens"] == TOKENS * r["requests"]
    assert len(server.requests) == r["requests"] + 2 and server.connections == 1
    head, body = server.requests[0]
    assert head.startswith(b"POST /v1/completions ") and len(body["prompt"]) == 12


def test_broken_replies_are_errors_and_never_hang():
    server = Scripted([CUT_OFF, NO_DONE, SILENT])
    r = load(server, streams=3, seconds=0, read_timeout_s=0.5)
    assert r["requests"] == 0 and r["tokens"] == 0
    assert r["error_kinds"] == {"connection_closed": 1, "stream_incomplete": 1, "timeout": 1}


def test_a_refused_connection_is_an_error():
    async def closed_port() -> int:
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        return port

    port = asyncio.run(closed_port())
    r = asyncio.run(run_load(LoadConfig(url=f"http://127.0.0.1:{port}", model="m", streams=2, seconds=0)))
    assert r["requests"] == 0 and r["error_kinds"] == {"connect_refused": 2}
