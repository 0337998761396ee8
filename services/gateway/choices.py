"""Responses of n > 1 choices (parallel sampling): the n streams of one request, each
read through its own handle (stream.Choices waits on all of them at once), written as
one SSE stream whose chunks carry their choice's `index`, or as one response with n
choices. usage.completion_tokens counts the tokens of every choice.

A choice ends on its own (its finish, or a stop string, which aborts only that child on
the workers); the request ends when every choice has. An error, the inactivity timeout
or the client going away ends them all.

With tools each choice has its own tool-call parser: it answers in text or in calls of
its own (their index counts within the choice, their ids are unique), and ends in
finish_reason tool_calls when it called one. A forced call holds for every choice: each
child samples under its own state of the request's grammar (shared/engine/fork.py).
"""

from __future__ import annotations

import time

import orjson
from opentelemetry import trace
from starlette.responses import JSONResponse, Response

from moemesh.services.gateway import openai_api as api
from moemesh.services.gateway import span_attrs as attrs
from moemesh.services.gateway.sse import unless_gone
from moemesh.services.gateway.stream import DISCONNECTED, TIMED_OUT, Choices, Reader
from moemesh.services.gateway.tool_calls import ToolCallParser


def _data(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _error(st, req) -> str:
    return f"no tokens for {st.cfg.inactivity_timeout_s:.0f}s; request aborted"


async def sse(st, req: api.GenerateRequest, group: Choices, span, t0: float, done):
    n = len(group.handles)
    readers = [Reader(st.tok, req.params.stop) for _ in range(n)]
    calls = _parsers(req, n)
    call_lps = [api.ToolLogprobs(req, st.tok) for _ in range(n)] if calls else None
    fast = [api.ChunkBytes(req, i) for i in range(n)]
    first = [True] * n
    finishes: list[str | None] = [None] * n
    cont, n_prompt = req.continuous_usage, len(req.prompt_ids)
    n_out, n_sent, status, open_, seen = 0, 0, 499, n, False  # n_sent: tokens in chunks written (all choices)
    stream_span = st.tracer.start_span("stream", context=trace.set_span_in_context(span),
                                       attributes={"choices": n})
    try:
        while open_:
            why = await group.wait()
            if why is DISCONNECTED:
                break
            if why is TIMED_OUT:
                group.close("timeout")
                stream_span.set_status(trace.StatusCode.ERROR, _error(st, req))
                status = 500
                yield _data({"error": api.ApiError(500, _error(st, req), type_="server_error").body()["error"]})
                break
            parts, failed = [], False
            for i, h in enumerate(group.handles):
                if h.closed or not h.ready:
                    continue
                ids, lps, finish, error = h.take()
                if ids and not seen:
                    seen = True
                    st.m["ttft"].observe(time.perf_counter() - t0)
                    stream_span.add_event("first_token")
                n_out += len(ids)
                k = 0  # the id of each token event, for the tool-call parser (it finds the markers by id)
                for ev in readers[i].events(ids, lps, finish, error):
                    if ev.error:
                        stream_span.set_status(trace.StatusCode.ERROR, ev.error)
                        parts.append(_data({"error": api.ApiError(500, ev.error, type_="server_error").body()["error"]}))
                        failed = True
                        break
                    n_sent += ev.token
                    if calls is not None:
                        tid = -1
                        if ev.token:
                            tid, k = ids[k], k + 1
                        for c in call_lps[i].put(api.tool_chunks(req, calls[i], tid, ev.text, ev.finish, first[i], i),
                                                 ev.logprob):
                            if cont:
                                c["usage"] = api.usage(n_prompt, n_sent, group.cached_tokens)
                            parts.append(_data(c))
                    elif not (first[i] or ev.finish or ev.logprob):
                        parts.append(fast[i].counted(ev.text, n_sent, group.cached_tokens) if cont
                                     else fast[i].text(ev.text))
                    else:
                        lp = api.logprobs_payload(req, st.tok, [ev.logprob] if ev.logprob else [])
                        c = api.chunk(req, ev.text, ev.finish, first[i], lp, i)
                        if cont:  # counts so far, every choice's
                            c["usage"] = api.usage(n_prompt, n_sent, group.cached_tokens)
                        parts.append(_data(c))
                    first[i] = False
                    if ev.finish is not None:
                        finishes[i] = api.tool_finish(ev.finish, calls[i].calls) if calls else ev.finish
                        h.close("stop_string" if readers[i].stopped_by_string else None)
                        open_ -= 1
                        break
                if failed:
                    break
            if failed:
                status = 500
                group.close("error")
                yield b"".join(parts)
                break
            if not open_:
                status = 200
                if req.include_usage:
                    parts.append(_data(api.usage_chunk(req, n_prompt, n_out, group.cached_tokens)))
                parts.append(b"data: [DONE]\n\n")
            if parts:
                yield b"".join(parts)
    finally:
        st.m["tokens"].inc(n_out)
        if not group.closed:  # the client went away (or the stream broke): stop the work
            group.close("client")
            stream_span.add_event("client_disconnected")
        stream_span.set_attribute("completion.tokens", n_out)
        stream_span.end()
        _usage_attrs(span, req, n_out, finishes, group)
        done(status)


def _parsers(req: api.GenerateRequest, n: int) -> list[ToolCallParser] | None:
    """One tool-call parser per choice, when the answers may hold calls."""
    return None if req.tools is None else [ToolCallParser(req.tools.markers) for _ in range(n)]


def _usage_attrs(span, req: api.GenerateRequest, n_out: int, finishes: list[str | None], group: Choices) -> None:
    if span.is_recording():
        span.set_attributes(attrs.gen_ai_usage(len(req.prompt_ids), n_out, None, group.cached_tokens))
        if all(finishes):
            span.set_attribute("gen_ai.response.finish_reasons", list(finishes))


async def collect(request, st, req: api.GenerateRequest, group: Choices, span, t0: float, done,
                  headers: dict[str, str]) -> Response:
    n = len(group.handles)

    async def gather():
        readers = [Reader(st.tok, req.params.stop) for _ in range(n)]
        calls = _parsers(req, n)
        texts: list[list[str]] = [[] for _ in range(n)]
        lps: list[list] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        n_out, seen = 0, False
        while not all(finish):
            if await group.wait() is TIMED_OUT:
                group.close("timeout")
                return None, n_out, _error(st, req)
            for i, h in enumerate(group.handles):
                if finish[i] is not None or not h.ready:
                    continue
                ids, wire_lps, fin, error = h.take()
                if ids and not seen:
                    seen = True
                    st.m["ttft"].observe(time.perf_counter() - t0)
                n_out += len(ids)
                k = 0
                for ev in readers[i].events(ids, wire_lps, fin, error):
                    if ev.error:
                        group.close("error")
                        return None, n_out, ev.error
                    if calls is None:
                        texts[i].append(ev.text)
                    else:  # the content is what the parser finds outside the calls
                        tid = -1
                        if ev.token:
                            tid, k = ids[k], k + 1
                        texts[i] += [d.content for d in calls[i].feed(tid, ev.text) if d.content]
                    if ev.logprob is not None:
                        lps[i].append(ev.logprob)
                    if ev.finish:
                        h.close("stop_string" if readers[i].stopped_by_string else None)
                        finish[i] = api.tool_finish(ev.finish, calls[i].calls) if calls else ev.finish
                        break
        return [("".join(t), f, api.logprobs_payload(req, st.tok, lp), calls[i].calls if calls else None)
                for i, (t, f, lp) in enumerate(zip(texts, finish, lps))], n_out, None

    gone, work = await unless_gone(request, gather(), group)
    if gone:
        done(499)
        return Response(status_code=499)
    try:
        choices, n_out, error = work.result()
    except Exception:
        group.close("client")
        done(500)
        raise
    st.m["tokens"].inc(n_out)
    if error:
        done(500)
        return JSONResponse(api.ApiError(500, error, type_="server_error").body(), status_code=500)
    _usage_attrs(span, req, n_out, [c[1] for c in choices], group)
    done(200)
    return JSONResponse(api.final_choices(req, choices, len(req.prompt_ids), n_out, group.cached_tokens),
                        headers=headers)
