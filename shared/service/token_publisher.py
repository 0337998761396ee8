"""A worker's token streams to the gateways: one TokenBatch per gateway per step, kept for
a while after it is sent, so that what a gateway missed can be sent again.

Every row carries its place in its request's output (`positions`), so a gateway sees a
lost batch (a gap) or one it already has (a repeat). When it sees a gap, when its NATS
connection comes back, or when a stream falls silent, it asks the workers that serve the
request to send again from the first position it lacks (TokenResend). The worker
answers from the batches it sent in the last `retention_s` seconds, on the gateway's
token subject, so the answer stays in order with the batches that follow it. A stream
whose missing part is older than that is ended with an error: never finished short.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from nats.aio.client import Client as NATS

from moemesh.shared.engine.outputs import Finished, StepOutputs
from moemesh.shared.protocol.messages import PromptLogprobs, TokenBatch, TokenEnd, TokenLogprob, TokenResend, encode
from moemesh.shared.protocol.subjects import Subjects

log = logging.getLogger(__name__)
MAX_KEPT_BATCHES = 20_000  # per gateway: a bound on memory whatever the step rate
LOST = "tokens of this stream were lost in transit and are no longer held by the worker"


class TokenPublisher:
    """Collects one step's tokens and sends one TokenBatch per gateway."""

    def __init__(self, nc: NATS, subjects: Subjects, worker_id: str, retention_s: float = 30.0):
        self._nc, self._subjects, self._worker = nc, subjects, worker_id
        self._pending: dict[str, TokenBatch] = {}
        self._kept: dict[str, deque[tuple[float, TokenBatch]]] = {}
        self._retention_s = retention_s
        self.resent_rows = 0
        self.lost_rows = 0
        self._dropped: set[str] = set()  # gateways some of whose kept batches were let go (retention)

    def add(self, gateway_id: str, request_id: str, token_ids: list[int], finish_reason: str | None = None,
            error: str | None = None, logprobs: list[TokenLogprob] | None = None, position: int = 0,
            cached_tokens: int | None = None, prompt_logprobs: PromptLogprobs | None = None) -> None:
        b = self._pending.get(gateway_id)
        if b is None:
            b = self._pending[gateway_id] = TokenBatch([], [], [], worker_id=self._worker)
        elif b.counts is None:  # a whole step went in as it was: copy before appending to it
            b = self._pending[gateway_id] = TokenBatch(list(b.request_ids), list(b.token_ids),
                                                       [1] * len(b.request_ids), list(b.ends), self._worker,
                                                       positions=list(b.positions), handoffs=dict(b.handoffs))
        if (finish_reason is not None or error is not None or logprobs or cached_tokens is not None
                or prompt_logprobs is not None):
            b.ends.append(TokenEnd(len(b.request_ids), finish_reason, error, logprobs, cached_tokens, prompt_logprobs))
        b.request_ids.append(request_id)
        b.token_ids += token_ids
        b.counts.append(len(token_ids))
        b.positions.append(position)

    def hand_off(self, gateway_id: str, request_id: str, worker_id: str) -> None:
        """Tell the gateway that worker_id serves the request from here on (a prefill
        worker handing the KV to another decode worker than the gateway chose). Goes out
        with the next flush, ahead of anything that worker sends."""
        b = self._pending.get(gateway_id)
        if b is None:
            b = self._pending[gateway_id] = TokenBatch([], [], [], worker_id=self._worker)
        b.handoffs[request_id] = worker_id

    def add_step(self, gateway_id: str, out: StepOutputs) -> None:
        """Every row of a step's outputs, for one gateway: the columns go out as they are."""
        ends = {e.row: f for e in out.extras if (f := end_fields(e)) != _NO_END}
        if gateway_id not in self._pending:
            self._pending[gateway_id] = TokenBatch(out.request_ids, out.token_ids, out.counts,
                                                   [TokenEnd(r, *f) for r, f in ends.items()], self._worker,
                                                   positions=out.positions)
            return
        for i, (rid, ids) in enumerate(rows(out)):  # rare: a step plus other updates
            self.add(gateway_id, rid, ids, *ends.get(i, _NO_END), position=out.positions[i])

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        if not pending:
            return
        now = time.time()
        for gw, batch in pending.items():
            batch.sent_at = now
            self._keep(gw, now, batch)
            try:
                await self._nc.publish(self._subjects.gateway_tokens(gw, self._worker), encode(batch))
            except Exception as e:  # NATS down: the gateway asks for the batch again (TokenResend)
                log.warning("token batch for gateway %s not sent: %s", gw, e)

    def _keep(self, gateway_id: str, now: float, batch: TokenBatch) -> None:
        kept = self._kept.get(gateway_id)
        if kept is None:
            kept = self._kept[gateway_id] = deque()
        kept.append((now, batch))
        while kept and (now - kept[0][0] > self._retention_s or len(kept) > MAX_KEPT_BATCHES):
            kept.popleft()
            self._dropped.add(gateway_id)

    def forget(self, gateway_id: str) -> None:
        """The gateway is gone: nobody will ask for its streams again."""
        self._kept.pop(gateway_id, None)
        self._dropped.discard(gateway_id)

    async def resend(self, r: TokenResend) -> None:
        """Send each asked-for request's ids again from its position, with its end if it
        has one; a request whose ids from there are no longer kept gets an error end. A
        request never seen here is left out (another worker serves that part)."""
        for rid, start in self.replay(r):
            self.add(r.gateway_id, rid, *start)
        await self.flush()

    def replay(self, r: TokenResend) -> list[tuple[str, tuple]]:
        """(request id, TokenPublisher.add's arguments after it) per request to send again."""
        want = dict(zip(r.request_ids, r.from_positions))
        found: dict[str, _Gathered] = {}
        for k, (_, b) in enumerate(self._kept.get(r.gateway_id, ())):
            ends = {e.row: e for e in b.ends} if b.ends else None
            i = 0
            for row, rid in enumerate(b.request_ids):
                n = 1 if b.counts is None else b.counts[row]
                if rid in want and b.positions:
                    g = found.get(rid)
                    if g is None:
                        g = found[rid] = _Gathered(want[rid], b.positions[row], k)
                    g.take(b.positions[row], b.token_ids[i : i + n], ends.get(row) if ends else None)
                i += n
        out = []
        dropped = r.gateway_id in self._dropped
        for rid, g in found.items():
            if g.first_pos > want[rid] and (g.first_batch > 0 or not dropped):
                # Its rows here began after the position asked for, and none of its earlier
                # batches were let go: the part before is another worker's (the prefill
                # worker's first token), which that worker sends again. Nothing is lost here;
                # calling it lost failed streams the prefill worker could still complete.
                continue
            if g.furthest > g.next:  # a hole: what it lacks is older than what is kept
                self.lost_rows += 1
                out.append((rid, ([], "error", LOST, None, 0)))
            elif g.ids or g.finish is not None or g.error is not None:
                self.resent_rows += 1
                out.append((rid, (g.ids, g.finish, g.error, g.logprobs or None, want[rid], g.cached, g.prompt)))
        return out


class _Gathered:
    """One request's kept rows from a position on, put back together."""

    __slots__ = ("next", "furthest", "ids", "logprobs", "finish", "error", "cached", "prompt", "first_pos",
                 "first_batch")

    def __init__(self, start: int, first_pos: int, first_batch: int):
        self.next = self.furthest = start
        self.first_pos, self.first_batch = first_pos, first_batch  # its first kept row, and that row's batch
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish = self.error = self.cached = self.prompt = None

    def take(self, pos: int, ids: list[int], end: TokenEnd | None) -> None:
        if ids:
            self.furthest = max(self.furthest, pos + len(ids))
            if pos <= self.next < pos + len(ids):  # goes on from what was gathered
                skip = self.next - pos
                self.ids += ids[skip:]
                if end is not None and end.logprobs:
                    self.logprobs += end.logprobs[skip:]
                if end is not None and end.prompt_logprobs is not None and not skip:  # with the first token
                    self.prompt = end.prompt_logprobs
                self.next = pos + len(ids)
        if end is not None and end.cached_tokens is not None:
            self.cached = end.cached_tokens
        if end is not None and (end.finish_reason is not None or end.error is not None):
            self.finish, self.error = end.finish_reason, end.error


_NO_END = (None, None, None)


def rows(out: StepOutputs):
    """(request id, its new ids) per row of a step's outputs."""
    if out.counts is None:
        yield from ((rid, [t]) for rid, t in zip(out.request_ids, out.token_ids))
        return
    i = 0
    for rid, n in zip(out.request_ids, out.counts):
        yield rid, out.token_ids[i : i + n]
        i += n


def end_fields(e: Finished) -> tuple:
    """(finish reason, error, logprobs) of a row's extras, as TokenEnd takes them."""
    return (e.finish_reason.value if e.finish_reason is not None else None, None, e.logprobs or None)
