"""The gateway's side of a worker's death: which workers are gone, and moving their
requests. MeshClient owns one Migration and gives it what it uses: the registry it
reads the beats into, its handles and the requests on their way, and how to send a job
or an abort.

Slow or dead: a worker that misses two beats (a suspect: one) is probed with a stats
request. Nothing subscribed ("no responders") means its process is gone, since the NATS
server drops a dead process's connection and subscriptions at once: its requests move
now. No answer in time means it is still subscribed, only not answering (stopped, a long
pause, cut off behind a live NATS connection): it keeps its streams until it has been
silent for silent_worker_limit intervals. A worker is also gone when it was draining and
its drain ran out, or when its last beat says it is leaving (a DEP rank whose peer
died: its engine can no longer step). Each of its requests that has not finished moves: the
gateway resubmits it as its prompt plus every id it has streamed so far, under a new
attempt id, at most max_migrations times; the client's stream goes on unbroken. A dead
prefill worker strands only what has not reached its decode worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Callable

from nats.aio.client import Client as NATS
from prometheus_client import Counter

from moemesh.services.gateway.streaming.choices import Handle
from moemesh.shared.protocol.messages import SamplingParams, StatsRequest, TokenEnd, WorkerStats
from moemesh.shared.protocol.registry import WorkerRegistry
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.nats_io import NoResponders, Unreachable, request
from moemesh.shared.service.tasks import TaskSet

log = logging.getLogger(__name__)
WATCH_EVERY_S = 0.25
PROBE_AFTER_BEATS, PROBE_SUSPECT_AFTER_BEATS = 2.0, 1.0
PROBE_TIMEOUT_S = 1.0
# Nothing subscribed to a silent worker's subjects means it is gone only when it stays so
# this long: a worker whose NATS node died is resubscribing on another node meanwhile.
RESUBSCRIBE_GRACE_S = 1.0
PAUSED_AFTER_S = 1.0  # check() runs every WATCH_EVERY_S: a gap this long is our own pause


class NoWorkers(RuntimeError):
    pass


class Rejected(RuntimeError):
    """A worker refused the request (bad parameters it caught, or draining)."""


class Migration:
    def __init__(self, registry: WorkerRegistry, subjects: Subjects, tasks: TaskSet, handles: dict[str, Handle],
                 sending: set[str], max_migrations: int, migrations: Counter,
                 send_job: Callable[[Handle, list[int], SamplingParams], Awaitable[None]],
                 send_abort: Callable[[str, str], Awaitable[None]], forget: Callable[[str], None],
                 nc: Callable[[], NATS | None]):
        """handles: the client's streams by request id; sending: the requests whose job is
        on its way (their sender sees them through a death, so they are not moved here);
        send_job(h, prompt, params) sends a moved request; send_abort(request_id, reason)
        aborts its old attempt; forget(worker) drops what the client knew of a gone worker;
        nc() is the client's connection, None while it has none (no probes then)."""
        self.registry, self.subjects, self._tasks = registry, subjects, tasks
        self.handles, self._sending = handles, sending
        self.max_migrations, self.c_migrations = max_migrations, migrations
        self._send_job, self._send_abort, self._forget = send_job, send_abort, forget
        self._nc = nc
        self._probing: set[str] = set()  # silent workers asked whether they are still there
        self._draining: dict[str, tuple[float, float]] = {}  # worker -> (last beat, silence that means dead)

    def beat(self, worker_id: str, draining: bool, interval_s: float) -> None:
        """A worker's beat. A draining one gets no new work, but its streams still come: if it
        dies before they end (its drain timed out), they move."""
        if draining:
            self._draining[worker_id] = (time.monotonic(), max(1.0, 2 * interval_s))
        else:
            self._draining.pop(worker_id, None)

    def left(self, worker_id: str) -> None:
        """Its last beat says it is leaving: its requests move now."""
        self._draining.pop(worker_id, None)
        self.gone([worker_id], "its worker left", seen="left")

    def recover(self) -> None:
        """Back from a NATS outage: a draining worker's silence counts from now."""
        now = time.monotonic()
        self._draining = {w: (now, t) for w, (_, t) in self._draining.items()}

    def suspect(self, worker_id: str, why: str) -> None:
        """No new requests go to the worker from now on; if its heartbeats stop too, its
        requests move sooner than by heartbeats alone (WorkerRegistry.suspect)."""
        if self.registry.suspect(worker_id):
            log.warning("worker %s is suspect (%s): no new requests go to it until it beats again", worker_id, why)

    def check(self) -> None:
        """Workers that fell silent: probed; the dead: their requests go elsewhere (each sweep)."""
        paused = self.registry.tick(PAUSED_AFTER_S)
        if paused:
            log.warning("the gateway did not run for %.1fs (stopped, or its event loop held): no worker is "
                        "judged by the beats it could not read meanwhile", paused)
            return
        if self._nc() is not None:
            for w in self.registry.silent(PROBE_AFTER_BEATS, PROBE_SUSPECT_AFTER_BEATS):
                if w not in self._probing:
                    self._probing.add(w)
                    self._tasks.spawn(self._probe(w), f"probe-{w}")
        dead = self.registry.prune()
        now = time.monotonic()
        if not self.registry.held:
            gone = [w for w, (seen, timeout) in self._draining.items() if now - seen > timeout]
            for w in gone:
                del self._draining[w]
            dead += gone
        self.gone(dead, "its worker stopped")

    def gone(self, dead: list[str], why: str, seen: str = "stopped sending heartbeats") -> None:
        """Workers known to be gone (silent, or they said they are leaving): their requests
        move. seen: how the gateway learnt it, for the log."""
        for w in dead:
            self._forget(w)
        if dead:
            self._migrate_from(set(dead), why, seen)

    async def watch(self) -> None:
        """The sweep, every WATCH_EVERY_S, until cancelled."""
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            self.check()

    async def _probe(self, worker_id: str) -> None:
        try:
            await request(self._nc(), self.subjects.stats(worker_id), StatsRequest(), WorkerStats, PROBE_TIMEOUT_S)
        except NoResponders:
            since = self.registry.unsubscribed(worker_id)
            if since is None:
                pass
            elif since < RESUBSCRIBE_GRACE_S:
                if since == 0.0:  # no new work meanwhile, whichever it is
                    self.suspect(worker_id, "silent, and nothing is subscribed to its subjects: gone, or moving "
                                 f"to another NATS node; asked again for {RESUBSCRIBE_GRACE_S:.1f}s")
            elif self.registry.confirm_gone(worker_id):
                log.warning("worker %s is gone: nothing has been subscribed to its subjects for %.1fs",
                            worker_id, since)
                self.check()
        except Unreachable:
            log.info("worker %s is silent but still subscribed: slow, not dead", worker_id)
        except Exception as e:  # a garbled reply still says it is there
            log.debug("probe of %s: %s", worker_id, e)
        finally:
            self._probing.discard(worker_id)

    def _migrate_from(self, dead: set[str], why: str, seen: str = "stopped sending heartbeats") -> None:
        # A dead prefill worker strands what has not reached its decode worker: no first
        # token yet, or the first token only (its KV may never have been handed off).
        moving = [h for h in self.handles.values() if not h.closed and h.finish is None
                  and h.request_id not in self._sending
                  and (h.decode_id in dead or (h.prefill_id in dead and h.next_pos <= 1))]
        for w in sorted(dead):
            n = sum(1 for h in moving if w in (h.decode_id, h.prefill_id))
            log.warning("worker %s %s: migrating its %d requests", w, seen, n)
        for h in moving:
            self._tasks.spawn(self._migrate(h, why), f"migrate-{h.request_id}")

    async def _migrate(self, h: Handle, why: str) -> None:
        """Resubmit h as its prompt plus every id it has streamed so far, to live workers:
        the new worker prefills that and goes on; the client's stream goes on unbroken."""
        if h.migrations >= self.max_migrations:
            h.end(TokenEnd(0, "error", f"request failed: {why} and it was moved {h.migrations} times already"))
            return
        old, done = h.request_id, len(h.streamed) + len(h.ids)
        if done >= h.params.max_tokens:  # all of it arrived; only its end was lost
            h.end(TokenEnd(0, "length"))
            return
        h.migrations += 1
        self.c_migrations.inc()
        self.handles.pop(old, None)  # late rows of the old attempt are not its
        self._tasks.spawn(self._send_abort(old, "migrated"), f"abort-{old}")
        h.request_id = f"{old.split('~', 1)[0]}~m{h.migrations}"
        h.next_pos, h.asked_at = 0, -1e9
        # The prompt's scores came with the first token: a new prefill of prompt + output
        # would score the output too, and the client has what it asked for.
        params = dataclasses.replace(h.params, max_tokens=h.params.max_tokens - done,
                                     min_tokens=max(0, h.params.min_tokens - done),
                                     prompt_logprobs=None if done else h.params.prompt_logprobs)
        prompt = h.prompt_ids + h.streamed + h.ids
        try:
            await self._send_job(h, prompt, params)
        except (NoWorkers, Rejected) as e:
            h.end(TokenEnd(0, "error", f"request failed: {why}, and it could not be moved ({e})"))
