"""/metrics and /health on their own address: the workers, the balancer and the KV store
(which have no web app), and the gateway when its metrics move off the public port.

/metrics is prometheus_client's own ASGI exposition (content negotiation: the text
format, OpenMetrics, gzip), mounted beside a /health route in a small Starlette app that
uvicorn serves on the service's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

import uvicorn
from prometheus_client import make_asgi_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from moemesh.shared.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the service owns its signals (shared/service/lifecycle.py)
        yield


def build_app(metrics: Metrics, health: Callable[[], dict]) -> Starlette:
    async def health_route(request: Request) -> JSONResponse:
        return JSONResponse(health())

    async def ready_route(request: Request) -> JSONResponse:
        # A draining worker is alive (liveness must not restart it mid-drain) but takes no
        # new work, so an orchestrator should stop counting it as ready.
        body = health()
        ready = not body.get("draining", False) and body.get("ready", True)
        return JSONResponse(body, status_code=200 if ready else 503)

    return Starlette(routes=[Route("/health", health_route, methods=["GET"]),
                             Route("/health/ready", ready_route, methods=["GET"]),
                             Route("/metrics", _Asgi(make_asgi_app(metrics.exposition())), methods=["GET"])])


class _Asgi:
    """An ASGI callable as a Route endpoint (a plain function would be taken for a request
    handler; a Mount would redirect /metrics to /metrics/)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


class MetricsServer:
    def __init__(self, metrics: Metrics, health: Callable[[], dict], host: str, port: int):
        self.host, self.port = host, port
        self._server = _Server(uvicorn.Config(build_app(metrics, health), host=host, port=port, log_level="warning",
                                              access_log=False, lifespan="off"))
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(), name="metrics-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # surfaces a bind error
                raise RuntimeError(f"metrics server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> "MetricsServer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
