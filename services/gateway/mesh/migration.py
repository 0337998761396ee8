"""The gateway's side of a worker's death: which workers are gone, and moving their
requests (MeshClient takes these methods from Migration).

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

from moemesh.services.gateway.streaming.stream import Handle
from moemesh.shared.protocol.messages import StatsRequest, TokenEnd, WorkerStats
from moemesh.shared.service.nats_io import NoResponders, Unreachable, request

log = logging.getLogger(__name__)
WATCH_EVERY_S = 0.25
PROBE_AFTER_BEATS, PROBE_SUSPECT_AFTER_BEATS = 2.0, 1.0
PROBE_TIMEOUT_S = 1.0
PAUSED_AFTER_S = 1.0  # _check_workers runs every WATCH_EVERY_S: a gap this long is our own pause


class NoWorkers(RuntimeError):
    pass


class Rejected(RuntimeError):
    """A worker refused the request (bad parameters it caught, or draining)."""


class Migration:
    def _suspect(self, worker_id: str, why: str) -> None:
        """No new requests go to the worker from now on; if its heartbeats stop too, its
        requests move sooner than by heartbeats alone (WorkerRegistry.suspect)."""
        if self.registry.suspect(worker_id):
            log.warning("worker %s is suspect (%s): no new requests go to it until it beats again", worker_id, why)

    def _check_workers(self) -> None:
        """Workers that fell silent: probed; the dead: their requests go elsewhere (each sweep)."""
        paused = self.registry.tick(PAUSED_AFTER_S)
        if paused:
            log.warning("the gateway did not run for %.1fs (stopped, or its event loop held): no worker is "
                        "judged by the beats it could not read meanwhile", paused)
            return
        if self.nc is not None:
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
        self._gone(dead, "its worker stopped")

    def _gone(self, dead: list[str], why: str, seen: str = "stopped sending heartbeats") -> None:
        """Workers known to be gone (silent, or they said they are leaving): their requests
        move. seen: how the gateway learnt it, for the log."""
        for w in dead:
            self.kv.forget(w)
            self._snapshots.discard(w)
        if dead:
            self._migrate_from(set(dead), why, seen)

    async def _probe(self, worker_id: str) -> None:
        try:
            await request(self.nc, self.subjects.stats(worker_id), StatsRequest(), WorkerStats, PROBE_TIMEOUT_S)
        except NoResponders:
            if self.registry.confirm_gone(worker_id):
                log.warning("worker %s is gone: nothing is subscribed to its subjects any more", worker_id)
                self._check_workers()
        except Unreachable:
            log.info("worker %s is silent but still subscribed: slow, not dead", worker_id)
        except Exception as e:  # a garbled reply still says it is there
            log.debug("probe of %s: %s", worker_id, e)
        finally:
            self._probing.discard(worker_id)

    async def _watch_workers(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            self._check_workers()

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
        if h.migrations >= self.cfg.max_migrations:
            h.end(TokenEnd(0, "error", f"request failed: {why} and it was moved {h.migrations} times already"))
            return
        old, done = h.request_id, len(h.streamed) + len(h.ids)
        if done >= h.params.max_tokens:  # all of it arrived; only its end was lost
            h.end(TokenEnd(0, "length"))
            return
        h.migrations += 1
        self.c_migrations.inc()
        self.handles.pop(old, None)  # late rows of the old attempt are not its
        self._tasks.spawn(self._send_abort(self.nc, old, "migrated"), f"abort-{old}")
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
