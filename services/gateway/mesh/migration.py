"""The gateway's side of a worker's death: which workers are gone, and moving their
requests (MeshClient takes these methods from Migration).

A worker is gone when its heartbeats stop (two missed intervals), or when it was
draining and its drain ran out. Each of its requests that has not finished moves: the
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
from moemesh.shared.protocol.messages import TokenEnd

log = logging.getLogger(__name__)
WATCH_EVERY_S = 0.25


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
        """Workers that fell silent: their requests go elsewhere (each sweep)."""
        dead = self.registry.prune()
        now = time.monotonic()
        if not self.registry.held:
            gone = [w for w, (seen, timeout) in self._draining.items() if now - seen > timeout]
            for w in gone:
                del self._draining[w]
            dead += gone
        for w in dead:
            self.kv.forget(w)
            self._snapshots.discard(w)
        if dead:
            self._migrate_from(set(dead), "its worker stopped")

    async def _watch_workers(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            self._check_workers()

    def _migrate_from(self, dead: set[str], why: str) -> None:
        # A dead prefill worker strands what has not reached its decode worker: no first
        # token yet, or the first token only (its KV may never have been handed off).
        moving = [h for h in self.handles.values() if not h.closed and h.finish is None
                  and h.request_id not in self._sending
                  and (h.decode_id in dead or (h.prefill_id in dead and h.next_pos <= 1))]
        for w in sorted(dead):
            n = sum(1 for h in moving if w in (h.decode_id, h.prefill_id))
            log.warning("worker %s stopped sending heartbeats: migrating its %d requests", w, n)
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
