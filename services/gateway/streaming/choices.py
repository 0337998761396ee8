"""One request's token stream at the gateway, from the ids workers send to the bytes the
client reads: its Handle, which the mesh client fills, and its response, for every n,
written as one SSE stream or gathered into one answer.

Stream lifecycle: open (the mesh client registers a Handle and sends the job) -> tokens
arrive (the mesh client appends ids to the handle and wakes its reader) -> the reader
takes everything that arrived, turns each token into one SSE event (incremental
detokenization, stop strings) and writes them in one chunk -> closed, exactly once, by
the reader through its handle: finished (the worker's finish reason or error), or
aborted on the workers (a stop string, the inactivity timeout, the client gone).

Nothing here runs per token but the detokenizer and the event's bytes: no task, no
queue and no timer per token. A stream that falls behind gets several events per write.

A request's group is what its reader waits on and closes: its Handle for n = 1 (a group
of one), its Choices for n > 1 (parallel sampling: n handles, one per choice, each its own
stream on the workers, waited on as one). Both answer handles, wait, close, closed,
cached_tokens and decode_id alike, so one response writer serves every n; with n > 1 its
chunks carry their choice's `index`. usage.completion_tokens counts the tokens of every
choice.

A choice ends on its own (its finish, or a stop string, which aborts only that child on
the workers); the response ends when every choice has. The inactivity timeout or the
client going away ends them all. So does an error, which a stream of one choice and
a stream of several end on differently, each as its clients have always read it: with
one choice the error is that choice's end, and usage and [DONE] follow it; with several,
the other children are aborted and the stream stops at the error chunk.

A completion's batch of prompts is one response too: choice p * n + i is prompt p's i-th,
each prompt a request of its own (of n choices). With echo a choice's first chunk, or its
answer, begins with its prompt (and, with logprobs, the prompt's tokens as the prefill
scored them; completion_logprobs.py); with max_tokens 0 that is all it holds, and the
token the workers sampled to score the prompt is not shown.

With tools each choice has its own tool-call parser: it answers in text or in calls of
its own (their index counts within the choice, their ids are unique), and ends in
finish_reason tool_calls when it called one. A forced call holds for every choice: each
child samples under its own state of the request's grammar (shared/engine/fork.py).

The hot path is a plain stream of one choice (no stop strings, logprobs or tools) after
its first chunk: `sse` writes each take's tokens straight from the detokenizer to bytes
(api.ChunkBytes), with no event, dict or call per token beyond those.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import orjson
from opentelemetry import trace
from starlette.responses import JSONResponse, Response

from moemesh.services.gateway.api import completion_logprobs as legacy
from moemesh.services.gateway.api import openai_api as api
from moemesh.services.gateway.api import span_attrs as attrs
from moemesh.services.gateway.api.tool_calls import ToolCallParser
from moemesh.services.gateway.http.server import unless_gone
from moemesh.shared.protocol.messages import PromptLogprobs, TokenEnd, TokenLogprob
from moemesh.shared.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)
TIMED_OUT = "timed_out"
DISCONNECTED = "disconnected"
GAP = -1  # Handle.put: a row before this one went missing; it waits for the resend that fills the gap
REFUSED = -2  # Handle.put: the sender does not serve the request
_DONE = b"data: [DONE]\n\n"
NO_SCORES = "the prompt's logprobs did not come with its first token"


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


class MissingScores(RuntimeError):
    """A choice's first token came without the prompt scores it asked for (a bug on a worker)."""


def _data(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _error_data(message: str) -> bytes:
    return _data({"error": api.ApiError(500, message, type_="server_error").body()["error"]})


class _Choice:
    """One choice as it is read: its handle, its detokenizer (with the stop strings), its
    tool-call parser, and what it has written or gathered so far."""

    __slots__ = ("index", "prompt", "handle", "reader", "calls", "first", "finish", "fast", "call_lps", "legacy",
                 "texts", "lps")

    def __init__(self, req: api.GenerateRequest, tok, handle: Handle, index: int, streamed: bool):
        self.index, self.handle = index, handle
        self.prompt = index // req.n  # its prompt, in a batch of them
        # completions' logprobs, whose text offsets run on from chunk to chunk
        self.legacy = legacy.LegacyLogprobs(tok, req.tokens_as_ids) \
            if req.kind == "completion" and req.logprobs is not None else None
        self.reader = Reader(tok, req.params.stop)
        self.calls = ToolCallParser(req.tools.markers) if req.tools is not None else None
        self.first = True  # nothing of it written yet: its first chunk carries the role
        self.finish: str | None = None  # as the client reads it (tool_calls where it called one)
        if streamed:
            self.fast = api.ChunkBytes(req, index)
            self.call_lps = api.ToolLogprobs(req, tok) if self.calls is not None else None
        else:
            self.texts: list[str] = []
            self.lps: list = []


class _Response:
    """What the two shapes of a response share: the choices of the request's group, the
    tokens taken of all of them, and how a choice, an error and a timeout end."""

    def __init__(self, st, req: api.GenerateRequest, group: Choices | Handle, t0: float, streamed: bool):
        self.req, self.tok, self.group, self.t0 = req, st.tok, group, t0
        self.ttft = st.m["ttft"]
        self.timeout_s = st.cfg.inactivity_timeout_s
        self.choices = [_Choice(req, st.tok, h, i, streamed) for i, h in enumerate(group.handles)]
        self.single = len(self.choices) == 1
        self.num_open = len(self.choices)
        self.n_prompt = sum(map(len, req.prompts))
        self.n_out = 0  # tokens taken, all choices
        self.t_first = 0.0  # when the first of them came (0: none yet)

    def ready(self) -> list[_Choice]:
        """The choices a wake of the group was for; with one, that one (its wake was for it)."""
        if self.single:
            return self.choices
        return [c for c in self.choices if not c.handle.closed and c.handle.ready]

    def took(self, ids: list[int], lps: list) -> tuple[list[int], list]:
        """What a choice's take writes: its ids, or with max_tokens 0 none (the token the
        workers sampled to score the prompt is not the client's)."""
        if ids and not self.t_first:
            self.t_first = time.perf_counter()
            self.ttft.observe(self.t_first - self.t0)
            self.first_token()
        if not self.req.generate:
            return [], []
        self.n_out += len(ids)
        return ids, lps

    def echo(self, c: _Choice, lps: list) -> tuple[str, dict | None]:
        """A completion choice's text prefix and logprobs for its first chunk (or its
        answer), of lps its generated tokens': the prompt first, with echo."""
        req, text = self.req, ""
        entries = legacy.generated_entries(lps)
        if req.echo:
            ids = req.prompts[c.prompt]
            text = req.prompt_texts[c.prompt]
            if text is None:
                text = self.tok.decode(ids, skip_special_tokens=False)
            if c.legacy is not None:
                entries = legacy.prompt_entries(ids, self._scores(c), req.logprobs) + entries
        return text, c.legacy.payload(entries) if c.legacy is not None and entries else None

    def prompt_logprobs(self, c: _Choice) -> list:
        """vLLM's prompt_logprobs of a choice's prompt."""
        return legacy.vllm_prompt_logprobs(self.req.prompts[c.prompt], self._scores(c), self.req.prompt_logprobs,
                                           self.tok, self.req.tokens_as_ids)

    def _scores(self, c: _Choice):
        if c.handle.prompt_logprobs is None:  # they come with the first token: a worker that did not send them
            raise MissingScores(c.index)
        return c.handle.prompt_logprobs

    def first_token(self) -> None:
        """A stream marks it on its span."""

    def ended(self, c: _Choice, finish: str) -> None:
        c.finish = api.tool_finish(finish, c.calls.calls) if c.calls is not None else finish
        c.handle.close("stop_string" if c.reader.stopped_by_string else None)
        self.num_open -= 1

    def failed(self) -> None:
        """A choice's worker ended it with an error. With one choice nothing else runs;
        with several the others still do: all are closed with an abort."""
        self.group.close(None if self.single else "error")

    def timed_out(self) -> str:
        self.group.close("timeout")
        return f"no tokens for {self.timeout_s:.0f}s; request aborted"

    def usage_attrs(self, span) -> None:
        if span.is_recording():
            span.set_attributes(attrs.gen_ai_usage(self.n_prompt, self.n_out, None, self.group.cached_tokens))
            finishes = [c.finish for c in self.choices]
            if all(finishes):
                span.set_attribute("gen_ai.response.finish_reasons", finishes)


class _Stream(_Response):
    """A response as SSE: each take of a choice as chunks, one per token event, and the
    usage and [DONE] when the last choice ends. `over`: nothing more is written."""

    def __init__(self, st, req: api.GenerateRequest, group: Choices | Handle, span, t0: float):
        super().__init__(st, req, group, t0, streamed=True)
        self.m, self.span = st.m, span
        self.cont = req.continuous_usage
        self.n_sent = 0  # tokens in the chunks written, all choices (continuous usage counts them)
        self.status = 499  # until the stream ends (the client left first)
        self.over = False
        self.stream_span = st.tracer.start_span("stream", context=trace.set_span_in_context(span),
                                                attributes=None if self.single else {"choices": len(self.choices)})

    def first_token(self) -> None:
        self.stream_span.add_event("first_token")

    def write(self, c: _Choice, ids, lps, finish, error, parts: list[bytes]) -> bool:
        """One choice's take as chunks onto parts. False: it failed, and no other choice's
        take goes out after it."""
        ids, lps = self.took(ids, lps)
        if self._events(c, ids, lps, finish, error, parts):
            return True
        self.status = 500
        self.failed()
        if self.single:  # the error is its end: usage and [DONE] follow, as on any end
            self.num_open = 0
        else:
            self.over = True
        return False

    def written(self, parts: list[bytes]) -> bytes:
        """The takes of one wake, in one write; with the usage and [DONE] once all ended."""
        if not self.num_open:
            self.status = 200 if self.status == 499 else self.status
            if self.req.include_usage:
                parts.append(_data(api.usage_chunk(self.req, self.n_prompt, self.n_out, self.group.cached_tokens)))
            parts.append(_DONE)
            self.over = True
        return b"".join(parts)

    def _events(self, c: _Choice, ids, lps, finish, error, parts: list[bytes]) -> bool:
        """One choice's take as chunks onto parts. False: it failed (the error chunk is its last)."""
        k = 0  # the id of each token event, for the tool-call parser (it finds the markers by id)
        for ev in c.reader.events(ids, lps, finish, error):
            if ev.error:
                self.stream_span.set_status(trace.StatusCode.ERROR, ev.error)
                parts.append(_error_data(ev.error))
                return False
            self.n_sent += ev.token
            if c.calls is not None:
                tid = -1
                if ev.token:
                    tid, k = ids[k], k + 1
                chunks = api.tool_chunks(self.req, c.calls, tid, ev.text, ev.finish, c.first, c.index)
                parts += [self._dumps(ch) for ch in c.call_lps.put(chunks, ev.logprob)]
            elif not (c.first or ev.finish or ev.logprob):
                parts.append(c.fast.counted(ev.text, self.n_sent, self.group.cached_tokens) if self.cont
                             else c.fast.text(ev.text))
            elif self.req.kind == "chat":
                lp = api.logprobs_payload(self.req, self.tok, [ev.logprob] if ev.logprob else [])
                parts.append(self._dumps(api.chunk(self.req, ev.text, ev.finish, c.first, lp, c.index)))
            else:
                try:
                    parts.append(self._dumps(self._completion_chunk(c, ev)))
                except MissingScores:
                    self.stream_span.set_status(trace.StatusCode.ERROR, NO_SCORES)
                    parts.append(_error_data(NO_SCORES))
                    return False
            c.first = False
            if ev.finish is not None:
                self.ended(c, ev.finish)
                break
        return True

    def _completion_chunk(self, c: _Choice, ev) -> dict:
        """A completion chunk: on a choice's first, its echoed prompt and prompt_logprobs."""
        if not c.first:
            lp = c.legacy.payload(legacy.generated_entries([ev.logprob])) if c.legacy and ev.logprob else None
            return api.chunk(self.req, ev.text, ev.finish, False, lp, c.index)
        prefix, lp = self.echo(c, [ev.logprob] if ev.logprob else [])
        out = api.chunk(self.req, prefix + ev.text, ev.finish, True, lp, c.index)
        if self.req.prompt_logprobs is not None:
            out["choices"][0]["prompt_logprobs"] = self.prompt_logprobs(c)
        return out

    def _dumps(self, chunk: dict) -> bytes:
        if self.cont:  # counts so far, every choice's
            chunk["usage"] = api.usage(self.n_prompt, self.n_sent, self.group.cached_tokens)
        return _data(chunk)

    def timed_out_chunk(self) -> bytes:
        err = self.timed_out()
        self.stream_span.set_status(trace.StatusCode.ERROR, err)
        self.status = 500
        return _error_data(err)

    def close(self) -> None:
        """However the stream ended: its counts, and its work stopped if the client left first."""
        self.m["tokens"].inc(self.n_out)  # once per request, not per token
        # Inter-token latency is one stream's: the tokens of several choices interleave.
        if self.single and self.status == 200 and self.n_out > 1:
            self.m["itl"].observe((time.perf_counter() - self.t_first) / (self.n_out - 1))
        if not self.group.closed:  # the client went away (or the stream broke): stop the work
            self.group.close("client")
            self.stream_span.add_event("client_disconnected")
        self.stream_span.set_attribute("completion.tokens", self.n_out)
        self.stream_span.end()
        self.usage_attrs(self.span)


async def sse(st, req: api.GenerateRequest, group: Choices | Handle, span, t0: float, done):
    """The response as one SSE stream. group: the request's handle (n = 1) or its Choices.
    Everything that arrived since the last write goes out in one write."""
    out = _Stream(st, req, group, span, t0)
    one = out.choices[0] if out.single else None
    plain = one is not None and not req.params.stop and req.logprobs is None and req.tools is None and req.generate
    hot = False  # the plain stream's first chunk is out: its tokens go on without events
    if one is not None:
        take, each, fast, cont = group.take, one.reader.detok.each, one.fast, req.continuous_usage
    try:
        while True:
            why = await group.wait()
            if why is not None:  # the client left, or the inactivity sweep gave up
                if why is TIMED_OUT:
                    yield out.timed_out_chunk()
                break
            parts: list[bytes] = []
            if one is None:
                for c in out.ready():
                    if not out.write(c, *c.handle.take(), parts):
                        break
            else:
                ids, lps, finish, error = take()
                if hot and finish is None and error is None:
                    n = out.n_out
                    out.n_out = out.n_sent = n + len(ids)  # plain: each id taken is a token written
                    if cont:
                        cached = group.cached_tokens
                        yield b"".join([fast.counted(t, n + i, cached) for i, t in enumerate(each(ids), 1)])
                    else:
                        yield fast.texts(each(ids))
                    continue
                out.write(one, ids, lps, finish, error, parts)
                hot = plain and not one.first
            chunk = out.written(parts)
            if chunk:
                yield chunk
            if out.over:
                break
    finally:
        out.close()
        done(out.status)


class _Answer(_Response):
    """A response as one answer: each choice's text, calls and logprobs, gathered."""

    async def gather(self) -> str | None:
        """Until every choice has ended. Returns the error that ended them all, if one did."""
        while self.num_open:
            if await self.group.wait() is TIMED_OUT:
                return self.timed_out()
            for c in self.ready():
                ids, lps, finish, error = c.handle.take()
                ids, lps = self.took(ids, lps)
                failure = self._events(c, ids, lps, finish, error)
                if failure is not None:
                    self.failed()
                    return failure
        return None

    def _events(self, c: _Choice, ids, lps, finish, error) -> str | None:
        """One choice's take into what it gathered. Returns the error that failed it, if one did."""
        k = 0
        for ev in c.reader.events(ids, lps, finish, error):
            if ev.error:
                return ev.error
            if c.calls is None:
                c.texts.append(ev.text)
            else:  # the content is what the parser finds outside the calls
                tid = -1
                if ev.token:
                    tid, k = ids[k], k + 1
                c.texts += [d.content for d in c.calls.feed(tid, ev.text) if d.content]
            if ev.logprob is not None:
                c.lps.append(ev.logprob)
            if ev.finish:
                self.ended(c, ev.finish)
                break
        return None

    def body(self) -> dict:
        """The answer; raises MissingScores when a choice lacks the prompt scores it asked for."""
        if self.req.kind == "chat":
            answers = [("".join(c.texts), c.finish, api.logprobs_payload(self.req, self.tok, c.lps),
                        c.calls.calls if c.calls is not None else None) for c in self.choices]
            return api.final_choices(self.req, answers, self.n_prompt, self.n_out, self.group.cached_tokens)
        answers = []
        for c in self.choices:
            prefix, lp = self.echo(c, c.lps)
            answers.append((prefix + "".join(c.texts), c.finish, lp))
        out = api.final_choices(self.req, answers, self.n_prompt, self.n_out, self.group.cached_tokens)
        if self.req.prompt_logprobs is not None:
            for c, choice in zip(self.choices, out["choices"]):
                choice["prompt_logprobs"] = self.prompt_logprobs(c)
        return out


async def collect(request, st, req: api.GenerateRequest, group: Choices | Handle, span, t0: float, done,
                  headers: dict[str, str]) -> Response:
    """The response as one answer, unless the client leaves first (499)."""
    answer = _Answer(st, req, group, t0, streamed=False)
    gone, work = await unless_gone(request, answer.gather(), group)
    if gone:
        done(499)
        return Response(status_code=499)
    try:
        error = work.result()
    except Exception:
        group.close("client")
        done(500)
        raise
    st.m["tokens"].inc(answer.n_out)
    if error:
        done(500)
        return JSONResponse(api.ApiError(500, error, type_="server_error").body(), status_code=500)
    try:
        body = answer.body()
    except MissingScores:
        log.error("request %s: %s", req.request_id, NO_SCORES)
        done(500)
        return JSONResponse(api.ApiError(500, NO_SCORES, type_="server_error").body(), status_code=500)
    answer.usage_attrs(span)
    done(200)
    return JSONResponse(body, headers=headers)
