"""The gateway below its routes: what uvicorn runs for each connection, and the ASGI layer
between it and the app. uvicorn's protocol with the slow-client deadlines and the body's
limits (SlowClientProtocol, read_body), the outermost ASGI layer (ServerSend), and the
response that writes a token stream through it (EventStream) or notices the client
leaving (disconnected, unless_gone).

Deadlines for slow clients: a connection holds a socket and a parser, so one that
trickles its request in must not hold them forever.

- headers: uvicorn closes idle keep-alive connections, but once a request's first byte
  has arrived it waits for the rest without limit. The protocol closes a connection whose
  request headers are not complete `header_timeout_s` after the request began (for the
  first request, after the connection opened);
- body: `read_body` reads at most `limit` bytes within `timeout_s`, else 413 or 408;
- an answer given before the body was all read (413, 408, 429, 401...): the client may
  still be writing it, as urllib and requests do before they read anything. Closing the
  socket then with unread bytes queued makes the kernel send a reset, and the client sees
  a network error instead of the status. So such a response says `connection: close`,
  then the server lingers: it half-closes, reads and discards what still comes, and
  closes once the client does, after `linger_bytes` more bytes, or `linger_s`, whichever
  comes first (nginx's lingering close).

The ASGI response for a token stream: server-sent events from an async iterator of byte
chunks. Starlette's StreamingResponse runs a task group of two tasks per response (one
sends, one listens for the client going away). Here the request's own task sends, and one
small task waits for the disconnect and wakes the stream's reader, so that a client that
leaves while its request waits for tokens is noticed at once.

The body chunks skip Starlette's middleware: each layer wraps `send` in a coroutine of
its own that only watches for the response start, and at one write per stream per step
those wrappers cost about as much as the rest of the token path in the gateway. The
start still goes through them, so they know the response began.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from moemesh.services.gateway.api.openai_api import ApiError

SERVER_SEND = "moemesh.server_send"  # scope key: the server's own send (see ServerSend)
_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class SlowClientProtocol(HttpToolsProtocol):
    header_timeout_s = 10.0  # set by slow_client_protocol
    linger_s = 5.0
    linger_bytes = 128 << 20
    _deadline: asyncio.TimerHandle | None = None
    _linger_left: int | None = None  # bytes still to discard; None: not lingering
    _stopping = False

    def _arm(self, delay: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.header_timeout_s)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:  # not an upgrade
            # Set before the cycle's task first runs, so the app is handed this send.
            self.cycle.send = self._early_answer_closes(self.cycle)

    def _early_answer_closes(self, cycle):
        send, early = cycle.send, False

        def checked_send(message):  # returns send's awaitable: no extra await a chunk
            nonlocal early
            if message["type"] == "http.response.start":
                early = cycle.more_body  # still True until the parser saw the body's end
                if early:
                    cycle.keep_alive = False  # uvicorn writes `connection: close`
            elif early and not message.get("more_body", False) and not self._stopping:
                # The close is ours (on_response_complete), not uvicorn's abrupt one.
                cycle.keep_alive = True
                self._linger_left = self.linger_bytes
            return send(message)

        return checked_send

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._linger_left is not None and not self.transport.is_closing():
            self._unset_keepalive_if_required()
            if self.transport.can_write_eof():
                self.transport.write_eof()  # after the response: the client reads it, then EOF
            self._arm(self.linger_s)

    def data_received(self, data: bytes) -> None:
        if self._linger_left is None:
            super().data_received(data)
            return
        self._linger_left -= len(data)  # the rest of a body already answered: not parsed
        if self._linger_left < 0:
            self.transport.close()

    def shutdown(self) -> None:
        # uvicorn closes a lingering connection here, and waits for the others to finish
        # their responses: one finishing now must not start lingering.
        self._stopping = True
        super().shutdown()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def slow_client_protocol(header_timeout_s: float, linger_s: float, linger_bytes: int) -> type:
    return type("SlowClientProtocol", (SlowClientProtocol,),
                {"header_timeout_s": header_timeout_s, "linger_s": linger_s, "linger_bytes": linger_bytes})


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, or ApiError 413 beyond `limit` bytes (checked against the
    declared length first, then as it arrives) and 408 past `timeout_s`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)

    async def read() -> bytes:
        parts, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise _too_large(limit)
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:.0f}s", code="body_timeout") from None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes", code="body_too_large")


class EventStream:
    """A token stream's response. handle: the request's Handle or Choices, whose
    disconnect() is called when the client goes."""

    def __init__(self, chunks: AsyncIterator[bytes], handle, headers: dict[str, str]):
        self.chunks = chunks
        self.handle = handle
        self.headers = _HEADERS + [(k.encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        send = scope.get(SERVER_SEND, send)
        watch = asyncio.ensure_future(disconnected(receive))
        watch.add_done_callback(lambda t: t.cancelled() or self.handle.disconnect())
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watch.cancel()
            await self.chunks.aclose()


async def unless_gone(request, gather, handle) -> tuple[bool, asyncio.Future]:
    """Runs a non-streamed answer's gather until it ends or the client leaves; when the
    client leaves first, the gather is cancelled and the request's work stopped.
    Returns (gone, the gather's future)."""
    work = asyncio.ensure_future(gather)
    watch = asyncio.ensure_future(disconnected(request.receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not work.done()
        if gone:  # the client went away (or this task was cancelled): stop the work
            work.cancel()
            handle.close("client")
    return gone, work


async def disconnected(receive) -> None:
    """Returns when the client has gone (for a request whose body is all read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ServerSend:
    """Outermost ASGI layer: puts the server's own send into the scope for EventStream."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        scope[SERVER_SEND] = send
        await self.app(scope, receive, send)
