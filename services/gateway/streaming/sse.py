"""The ASGI response for a token stream: server-sent events from an async iterator of
byte chunks.

Starlette's StreamingResponse runs a task group of two tasks per response (one sends,
one listens for the client going away). Here the request's own task sends, and one
small task waits for the disconnect and wakes the stream's reader, so that a client
that leaves while its request waits for tokens is noticed at once.

The body chunks skip Starlette's middleware: each layer wraps `send` in a coroutine of
its own that only watches for the response start, and at one write per stream per step
those wrappers cost about as much as the rest of the token path in the gateway. The
start still goes through them, so they know the response began.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from moemesh.services.gateway.streaming.stream import Handle

SERVER_SEND = "moemesh.server_send"  # scope key: the server's own send (see ServerSend)
_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class EventStream:
    def __init__(self, chunks: AsyncIterator[bytes], handle: Handle, headers: dict[str, str]):
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
