"""The gateway's side of the control plane: who is alive, where a request goes, and
the token streams coming back.

Each admitted request gets a Handle with a queue. Token batches from workers (one per
worker step) are decoded once and their updates fanned out to the queues.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS

from services.gateway.config import GatewayConfig
from services.gateway.router import pick_decode
from shared.protocol.messages import Abort, Ack, Heartbeat, PrefillJob, TokenBatch, TokenUpdate, WireSampling
from shared.protocol.subjects import Subjects
from shared.service.heartbeat import WorkerRegistry
from shared.service.nats_io import RemoteError, Unreachable, connect, publish, request, subscribe
from shared.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class NoWorkers(RuntimeError):
    pass


class Rejected(RuntimeError):
    """A worker refused the request (bad parameters it caught, or draining)."""


@dataclass
class Handle:
    request_id: str
    decode_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False


class MeshClient:
    def __init__(self, cfg: GatewayConfig, gateway_id: str | None = None):
        self.cfg = cfg
        self.gateway_id = gateway_id or cfg.worker_id or f"gw-{uuid.uuid4().hex[:8]}"
        self.subjects = Subjects(cfg.subject_prefix)
        self.registry = WorkerRegistry()
        self.handles: dict[str, Handle] = {}
        self._assigned: dict[str, int] = defaultdict(int)
        self.nc: NATS | None = None
        self._subs = []
        self.batches_received = 0

    async def start(self) -> None:
        self.nc = await connect(self.cfg, f"moemesh-gateway-{self.gateway_id}")
        s = self.subjects
        self._subs.append(await subscribe(self.nc, s.heartbeat_all, Heartbeat, self._on_heartbeat))
        self._subs.append(await subscribe(self.nc, s.gateway_tokens(self.gateway_id), TokenBatch, self._on_tokens))

    async def close(self) -> None:
        if self.nc is None:
            return
        nc, self.nc = self.nc, None
        try:
            await nc.drain()
        except Exception:
            await nc.close()

    # ---- workers ---------------------------------------------------------------------
    async def _on_heartbeat(self, hb: Heartbeat, msg, ctx) -> None:
        self.registry.observe(hb)
        self._assigned.pop(hb.worker_id, None)  # the beat now reflects what we sent

    def live(self, role: str) -> list[Heartbeat]:
        return self.registry.live(role)

    # ---- requests --------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     headers: dict | None) -> Handle:
        decode = pick_decode(self.live("decode"), self._assigned)
        if decode is None:
            raise NoWorkers("no decode worker is alive")
        if not self.cfg.decode_only_bench and not self.live("prefill"):
            raise NoWorkers("no prefill worker is alive")
        h = Handle(request_id, decode.worker_id)
        self.handles[request_id] = h
        self._assigned[decode.worker_id] += params.max_tokens
        job = PrefillJob(request_id, list(prompt_ids), WireSampling.from_params(params), self.gateway_id,
                         decode.worker_id, time.time())
        subject = (self.subjects.decode_bench_job(decode.worker_id) if self.cfg.decode_only_bench
                   else self.subjects.prefill_jobs)
        try:
            await request(self.nc, subject, job, Ack, self.cfg.prefill_timeout_s, headers)
        except Unreachable as e:
            self.handles.pop(request_id, None)
            raise NoWorkers(f"no prefill worker took the request: {e}") from None
        except RemoteError as e:
            self.handles.pop(request_id, None)
            if e.reply.code == "unavailable":
                raise NoWorkers(str(e)) from None
            raise Rejected(e.reply.error) from None
        return h

    async def _on_tokens(self, batch: TokenBatch, msg, ctx) -> None:
        self.batches_received += 1
        for u in batch.updates:
            h = self.handles.get(u.request_id)
            if h is not None:
                h.queue.put_nowait(u)

    def finish(self, request_id: str) -> None:
        self.handles.pop(request_id, None)

    async def abort(self, request_id: str, reason: str = "client") -> None:
        self.handles.pop(request_id, None)
        if self.nc is not None:
            try:
                await publish(self.nc, self.subjects.abort, Abort([request_id], reason))
            except Exception as e:
                log.warning("abort for %s not sent: %s", request_id, e)

    def abort_soon(self, request_id: str, reason: str = "client") -> None:
        """From a cancelled context (a client that went away), where awaiting is not possible."""
        asyncio.get_running_loop().create_task(self.abort(request_id, reason))


def error_update(request_id: str, error: str) -> TokenUpdate:
    return TokenUpdate(request_id, [], "error", error=error)
