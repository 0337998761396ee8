"""The gateway process: the Starlette app under uvicorn, as an async context manager."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from moemesh.services.gateway.config import GatewayConfig
from moemesh.services.gateway.http.app import build_app
from moemesh.services.gateway.http.server import ServerSend, slow_client_protocol
from moemesh.shared.service.lifecycle import AsyncService

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    # The service owns signal handling (moemesh.shared.service.lifecycle); uvicorn must not.
    @contextlib.contextmanager
    def capture_signals(self):
        yield


class GatewayService(AsyncService):
    def __init__(self, cfg: GatewayConfig, gateway_id: str | None = None):
        self.cfg = cfg
        self.app = build_app(cfg, gateway_id)
        self._server = _Server(uvicorn.Config(ServerSend(self.app), host=cfg.host, port=cfg.port, log_level="warning",
                                              lifespan="on", access_log=False, timeout_graceful_shutdown=5,
                                              http=slow_client_protocol(cfg.header_timeout_s, cfg.linger_s,
                                                                        cfg.linger_bytes)))
        self._task: asyncio.Task | None = None
        self.port = cfg.port

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(), name="uvicorn")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # surfaces the startup error
                raise RuntimeError("gateway failed to start")
            await asyncio.sleep(0.02)
        sock = self._server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        log.info("gateway listening on http://%s:%d", self.cfg.host, self.port)

    @property
    def state(self):
        return self.app.state.gw

    async def drain(self) -> None:
        st = self.state
        st.draining = True
        st.gate.close()  # those waiting for a slot get a 503; those in flight finish
        while st.inflight:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        task, self._task = self._task, None
        try:
            await asyncio.wait_for(task, 10)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            task.cancel()
