"""The lifecycles of a service's parts, as async context managers.

A service enters its parts in order on an `AsyncExitStack` and leaves them in reverse:
what was started last (heartbeats) stops first, and what everything else uses (the
connection, the transport, tracing) goes last. Each part is handed what it uses (a
connection, an engine, a callback), never the service that holds it.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from nats.aio.client import Client as NATS
from opentelemetry.sdk.trace import TracerProvider

from moemesh.shared.config.common import ServiceConfig
from moemesh.shared.protocol.messages import Heartbeat
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.engine_loop import EngineLoop
from moemesh.shared.service.nats_io import Handler, LinkEvents, connect, disconnect, publish, subscribe
from moemesh.shared.service.tasks import TaskSet
from moemesh.shared.telemetry.tracing import setup_tracing, shutdown
from moemesh.shared.transport.base import KVTransport

TransportFactory = Callable[[], KVTransport]


class Bus:
    """The service's NATS connection: connected on enter, drained on exit (in-flight
    handlers finish, pending publishes go out). Subscriptions validate their messages
    (nats_io.subscribe); a concurrent one runs each handler as a task of `tasks`, which
    its owner cancels when it closes."""

    def __init__(self, cfg: ServiceConfig, name: str, subjects: Subjects, tasks: TaskSet):
        self._cfg, self._name, self.subjects, self._tasks = cfg, name, subjects, tasks
        self.nc: NATS | None = None
        self.link = LinkEvents()
        self._beat_listeners: list[Callable[[Heartbeat], None]] = []

    async def __aenter__(self) -> "Bus":
        self.nc = await connect(self._cfg, self._name, self.link)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.nc is not None:
            nc, self.nc = self.nc, None
            await disconnect(nc)

    async def sub(self, subject: str, cls: type, handler: Handler, queue: str = "", concurrent: bool = False):
        return await subscribe(self.nc, subject, cls, handler, queue, self._tasks.spawn if concurrent else None)

    async def publish(self, subject: str, obj) -> None:
        await publish(self.nc, subject, obj)

    async def on_heartbeat(self, listener: Callable[[Heartbeat], None]) -> None:
        """Hear every heartbeat of the mesh. All of a worker's listeners (its gateways,
        its KV peers, its DEP instance's ranks) share one subscription, and each beat is
        decoded once."""
        self._beat_listeners.append(listener)
        if len(self._beat_listeners) == 1:
            await self.sub(self.subjects.heartbeat_all, Heartbeat, self._fan_out)

    async def _fan_out(self, hb: Heartbeat, msg, ctx) -> None:
        for listener in self._beat_listeners:
            listener(hb)


def ucx_transport(cfg: ServiceConfig) -> TransportFactory:
    """Production's transport (cfg has the UCX settings). Tests give a service the
    loopback double instead, by argument: no setting can make production run it."""

    def make() -> KVTransport:
        from moemesh.shared.transport.ucx import UcxTransport  # ucxx loads only where it is used

        return UcxTransport(cfg.ucx_net_devices, cfg.ucx_tls, cfg.ucx_send_spin_us)

    return make


@asynccontextmanager
async def opened(transport: KVTransport) -> AsyncIterator[KVTransport]:
    """A transport, started; closed on the way out (also when starting failed half-way)."""
    try:
        await transport.start()
        yield transport
    finally:
        await transport.close()


@asynccontextmanager
async def tracing(service_name: str, trace_file: str, otlp_endpoint: str) -> AsyncIterator[TracerProvider]:
    provider = setup_tracing(service_name, trace_file or None, otlp_endpoint or None)
    try:
        yield provider
    finally:
        shutdown(provider)


@asynccontextmanager
async def running(loop: EngineLoop, lockstep_timeout_s: float) -> AsyncIterator[asyncio.Task]:
    """The engine loop, running in a task; on the way out it stops. A lockstep rank stops
    with all the ranks (a collective decides): cancelling one would leave the others
    waiting on it until the group's timeout."""
    tasks = TaskSet()
    task = tasks.spawn(loop.run(), "engine-loop")
    try:
        yield task
    finally:
        loop.stop()
        if loop.lockstep is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), lockstep_timeout_s)
            except (asyncio.TimeoutError, Exception):
                pass
        await tasks.close()
