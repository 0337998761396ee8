"""One request's token stream at the gateway, from the ids workers send to the bytes the
client reads.

Stream lifecycle: open (the mesh client registers a Handle and sends the job) -> tokens
arrive (the mesh client appends ids to the handle and wakes its reader) -> the reader
takes everything that arrived, turns each token into one SSE event (incremental
detokenization, stop strings) and writes them in one chunk -> closed, exactly once, by
the reader through its handle: finished (the worker's finish reason or error), or
aborted on the workers (a stop string, the inactivity timeout, the client gone).

Nothing here runs per token but the detokenizer and the event's bytes: no task, no
queue and no timer per token. A stream that falls behind gets several events per write.

A request's group is what its reader waits on and closes: its Handle for n = 1 (a group
of one), its Choices for n > 1. Both answer handles, wait, close, closed, cached_tokens
and decode_id alike, so one response writer (choices.py) serves every n.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from moemesh.shared.protocol.messages import PromptLogprobs, TokenEnd, TokenLogprob
from moemesh.shared.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

TIMED_OUT = "timed_out"
DISCONNECTED = "disconnected"
GAP = -1  # Handle.put: a row before this one went missing; it waits for the resend that fills the gap
REFUSED = -2  # Handle.put: the sender does not serve the request


class Handle:
    """One admitted request at the gateway: what has arrived for it and not been taken
    yet, and the one place its end goes through. Filled by the mesh client (one batch per
    worker step), emptied by the request's reader, which ends it with close()."""

    __slots__ = ("request_id", "decode_id", "prefill_id", "ids", "logprobs", "finish", "error", "last_seen",
                 "gone", "closed", "next_pos", "asked_at", "prompt_ids", "params", "headers", "migrations",
                 "streamed", "cached_tokens", "_cached_known", "prompt_logprobs",
                 "_waiter", "_on_close")

    def __init__(self, request_id: str, decode_id: str, on_close: Callable[[str, str | None], None],
                 now: float = 0.0):
        """on_close(request_id, abort_reason): the mesh client forgets the request and,
        with a reason, tells the workers to stop it."""
        self.request_id = request_id
        self.decode_id = decode_id
        self.prefill_id = ""
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish: str | None = None
        self.error: str | None = None
        self.last_seen = now  # loop time of the last arrival
        self.gone = False  # the client went away
        self.closed = False
        self.next_pos = 0  # the position in the output of the next id this stream takes
        # what resubmits it when its worker dies (request migration)
        self.prompt_ids: list[int] = []
        self.params = None
        self.headers: dict | None = None
        self.migrations = 0
        self.streamed: list[int] = []  # ids the reader has taken
        self.asked_at = -1e9  # loop time of the last resend asked for it
        self.cached_tokens = 0  # prompt tokens the first prefill found cached (usage reports them)
        self._cached_known = False
        # the prompt's scores, when asked for: they come with the first token, before the reader takes it
        self.prompt_logprobs: PromptLogprobs | None = None
        self._waiter: asyncio.Future | None = None
        self._on_close = on_close

    def close(self, abort: str | None = None) -> None:
        """The request is over at the gateway. With a reason (stop_string, timeout,
        client), the workers are told to abort it: they would keep generating otherwise.
        Only the first call counts, so every exit path of a reader may call it."""
        if self.closed:
            return
        self.closed = True
        self._on_close(self.request_id, abort)

    def put(self, worker_id: str, ids: list[int], start: int, n: int, pos: int, now: float) -> int:
        """The one rule of what a stream takes from a worker's token row: n ids from
        ids[start], the first at output position pos (a worker that does not number its rows:
        pass next_pos, and they are taken as they come). Only a worker that serves the
        request is heard: the prefill worker it went to, or the decode worker it was handed
        to. Of a row sent again, only the ids the stream lacks are taken. Returns how many
        ids were new, GAP or REFUSED."""
        if worker_id != self.decode_id and worker_id != self.prefill_id:
            return REFUSED
        want = self.next_pos
        if pos == want:  # the common case
            if n == 1:
                self.ids.append(ids[start])
            elif n:
                self.ids += ids[start : start + n]
            else:
                return 0
            new = n
        elif pos > want:
            return GAP if n else 0  # a row without ids shows no gap
        else:
            new = pos + n - want
            if new <= 0:
                return 0
            self.ids += ids[start + n - new : start + n]
        self.next_pos = pos + n
        self.last_seen = now
        w = self._waiter  # wake(), inline: this runs once per token
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)
        return new

    def wake(self, why: object = None) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(why)

    def end(self, e: TokenEnd) -> None:
        if e.cached_tokens is not None and not self._cached_known:  # a migration's prefill does not count
            self.cached_tokens, self._cached_known = e.cached_tokens, True
        if e.logprobs:
            self.logprobs += e.logprobs
        if e.prompt_logprobs is not None and self.prompt_logprobs is None:  # a migration's prompt is longer
            self.prompt_logprobs = e.prompt_logprobs
        if e.finish_reason is not None:
            self.finish, self.error = e.finish_reason, e.error
        self.wake()

    def disconnect(self) -> None:
        self.gone = True
        self.wake(DISCONNECTED)

    @property
    def waiting(self) -> bool:
        return self._waiter is not None

    async def wait(self) -> object:
        """Until something arrives (None), the inactivity sweep gives up (TIMED_OUT), or
        the client goes away (DISCONNECTED)."""
        if self.gone:
            return DISCONNECTED
        if self.ids or self.finish is not None:
            return None
        self._waiter = asyncio.get_running_loop().create_future()
        return await self._waiter

    def take(self) -> tuple[list[int], list[TokenLogprob], str | None, str | None]:
        ids, lps = self.ids, self.logprobs
        self.ids, self.logprobs = [], []
        self.streamed += ids
        return ids, lps, self.finish, self.error

    @property
    def ready(self) -> bool:
        return bool(self.ids) or self.finish is not None

    @property
    def handles(self) -> list[Handle]:
        """As Choices.handles: a request of n = 1 is the group of its one handle."""
        return [self]

    def watch(self, fut: asyncio.Future | None) -> None:
        """Wake `fut` when something arrives: the one wait of a request's n handles (Choices)."""
        self._waiter = fut


class Choices:
    """The n handles of a request of n > 1 (one per choice, each its own stream on the
    workers), waited on as one: a wait ends when any of them has something. Closing it
    closes those still open."""

    def __init__(self, handles: list[Handle]):
        self.handles = handles
        self.gone = False

    @property
    def decode_id(self) -> str:
        return self.handles[0].decode_id

    @property
    def closed(self) -> bool:
        return all(h.closed for h in self.handles)

    @property
    def cached_tokens(self) -> int:
        return max(h.cached_tokens for h in self.handles)

    def close(self, abort: str | None = None) -> None:
        for h in self.handles:
            h.close(abort)

    def disconnect(self) -> None:
        self.gone = True
        for h in self.handles:
            h.disconnect()

    async def wait(self) -> object:
        """As Handle.wait, for the handles not closed yet."""
        if self.gone:
            return DISCONNECTED
        open_ = [h for h in self.handles if not h.closed]
        if any(h.ready for h in open_):
            return None
        fut = asyncio.get_running_loop().create_future()
        for h in open_:
            h.watch(fut)
        try:
            return await fut
        finally:
            for h in open_:
                h.watch(None)


@dataclass
class Event:
    """One token's worth of a response (or the end of one)."""
    text: str = ""
    finish: str | None = None  # stop | length | abort | error
    error: str | None = None
    logprob: TokenLogprob | None = None
    token: bool = True  # False: an end with no token of its own


@dataclass
class Reader:
    """Turns what a handle took into events; keeps the detokenizer between takes."""
    tok: Tokenizer
    stop: tuple[str, ...]
    detok: IncrementalDetokenizer = field(init=False)
    stopped_by_string: bool = False

    def __post_init__(self):
        self.detok = IncrementalDetokenizer(self.tok, self.stop)

    def events(self, ids: list[int], lps: list[TokenLogprob], finish: str | None,
               error: str | None) -> list[Event]:
        """One event per token, then, at the end, one that carries the finish (as OpenAI's
        API sends it: a chunk of its own). A stop string ends the stream at the token that
        completes it."""
        if error is not None:
            return [Event(finish="error", error=error, token=False)]
        add, detok, out = self.detok.add, self.detok, []
        for i, t in enumerate(ids):
            out.append(Event(add([t]), logprob=lps[i] if i < len(lps) else None))
            if detok.stopped:
                self.stopped_by_string = finish is None  # the worker does not know: abort it
                out.append(Event("", "stop", token=False))
                return out
        if finish is not None:
            out.append(Event(detok.flush(), finish, token=False))
        return out


async def sweep_inactive(handles: dict[str, Handle], timeout_s: float, every_s: float = 1.0,
                         silent_s: float = 0.0, on_silent: Callable[[list[Handle]], None] | None = None) -> None:
    """Wakes readers whose request has had nothing for timeout_s with TIMED_OUT: one timer
    for the whole gateway instead of one per wait. Streams silent for silent_s are given to
    on_silent first (the gateway asks their workers what it may have missed)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(min(every_s, timeout_s, silent_s or every_s))
        now = loop.time()
        silent = []
        for h in list(handles.values()):
            if h.waiting and now - h.last_seen > timeout_s:
                h.wake(TIMED_OUT)
            elif on_silent is not None and now - h.last_seen > silent_s and now - h.asked_at > silent_s:
                silent.append(h)
        if silent:
            on_silent(silent)
