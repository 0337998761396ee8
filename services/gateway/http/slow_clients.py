"""Deadlines for slow clients: a connection holds a socket and a parser, so one that
trickles its request in must not hold them forever.

- headers: uvicorn closes idle keep-alive connections, but once a request's first byte
  has arrived it waits for the rest without limit. `HeaderDeadlineProtocol` closes a
  connection whose request headers are not complete `header_timeout_s` after the
  request began (for the first request, after the connection opened);
- body: `read_body` reads at most `limit` bytes within `timeout_s`, else 413 or 408.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from moemesh.services.gateway.api.openai_api import ApiError


def header_deadline_protocol(header_timeout_s: float) -> type:
    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout_s, self._too_slow)

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
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol


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
