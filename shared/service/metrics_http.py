"""A minimal HTTP endpoint for /metrics and /health on services that have no web app.

asyncio's own server, two routes, no framework: workers and the balancer expose their
Prometheus metrics without carrying an ASGI stack.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

log = logging.getLogger(__name__)


class MetricsServer:
    def __init__(self, render: Callable[[], tuple[bytes, str]], health: Callable[[], dict], host: str, port: int):
        self._render, self._health, self.host, self.port = render, health, host, port
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> "MetricsServer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass  # headers are not needed
            parts = line.decode(errors="replace").split()
            path = parts[1] if len(parts) > 1 else ""
            if parts and parts[0] != "GET":
                status, body, ctype = "405 Method Not Allowed", b"", "text/plain"
            elif path.startswith("/metrics"):
                body, ctype = self._render()
                status = "200 OK"
            elif path.startswith("/health"):
                body, ctype, status = json.dumps(self._health()).encode(), "application/json", "200 OK"
            else:
                status, body, ctype = "404 Not Found", b"not found\n", "text/plain"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError) as e:
            log.debug("metrics request dropped: %s", e)
        finally:
            writer.close()
