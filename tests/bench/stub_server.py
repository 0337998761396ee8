"""A trivial OpenAI-compatible server for the `bench serve` tests: fake SSE chunks for
completions and chat, a delay per token, and failures on a schedule."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class StubState:
    delay_s: float = 0.002  # per token
    tokens_per_chunk: int = 1
    continuous_usage: bool = False  # usage on every chunk, as vLLM's continuous_usage_stats
    fail_every: int = 0  # every n-th request (1-based) gets fail_status
    fail_status: int = 500
    bad_every: int = 0  # every n-th request gets a 400
    stream_error_every: int = 0  # every n-th request fails after two chunks
    workers: tuple[str, ...] = ("w0", "w1")
    token_text: str = "tok "  # what each token streams as
    line_end: str = "\n"  # of SSE lines: \n, \r\n or \r are all valid
    max_model_len: int = 0  # reported on /v1/models (as vLLM and moemesh do) if set
    bodies: list[dict] = field(default_factory=list)

    def reset(self, **kw) -> None:
        fresh = StubState(**kw)
        self.__dict__.update(fresh.__dict__)


def _hit(n: int, every: int) -> bool:
    return every > 0 and n % every == 0


def make_app(state: StubState) -> Starlette:
    async def models(_: Request) -> JSONResponse:
        card = {"id": "stub-model", "object": "model"} | ({"max_model_len": state.max_model_len}
                                                         if state.max_model_len else {})
        return JSONResponse({"object": "list", "data": [card]})

    async def generate(request: Request):
        body = await request.json()
        state.bodies.append(body)
        n = len(state.bodies)
        if _hit(n, state.bad_every):
            return JSONResponse({"error": {"message": "bad request from stub", "type": "invalid_request_error"}}, 400)
        if _hit(n, state.fail_every):
            return JSONResponse({"error": {"message": "stub failure", "type": "server_error"}}, state.fail_status)
        chat = request.url.path.endswith("/chat/completions")
        prompt = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        max_tokens = int(body["max_tokens"])
        include_usage = (body.get("stream_options") or {}).get("include_usage", False)
        usage = lambda k: {"prompt_tokens": len(prompt.split()), "completion_tokens": k,  # noqa: E731
                           "total_tokens": len(prompt.split()) + k}

        def chunk(text: str, finish: str | None, sent: int) -> str:
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text, "finish_reason": finish})
            ev = {"id": f"r{n}", "object": "chunk", "model": "stub-model", "choices": [choice]}
            if state.continuous_usage:
                ev["usage"] = usage(sent)
            # raw UTF-8, not \\u escapes: a line splitter that breaks at U+2028 would break here
            return f"data: {json.dumps(ev, ensure_ascii=False)}\n\n"

        async def stream():
            if chat:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
            sent = 0
            while sent < max_tokens:
                k = min(state.tokens_per_chunk, max_tokens - sent)
                await asyncio.sleep(state.delay_s * k)
                sent += k
                if _hit(n, state.stream_error_every) and sent > 2:
                    yield f"data: {json.dumps({'error': {'message': 'stub stream broke'}})}\n\n"
                    return
                yield chunk(state.token_text * k, "length" if sent == max_tokens else None, sent)
            if include_usage:
                yield f"data: {json.dumps({'choices': [], 'usage': usage(sent)})}\n\n"
            yield "data: [DONE]\n\n"

        headers = {"x-moemesh-worker": state.workers[n % len(state.workers)]} if state.workers else {}
        async def framed():
            async for s in stream():
                yield s.replace("\n", state.line_end)

        return StreamingResponse(framed(), media_type="text/event-stream", headers=headers)

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"])])


class StubServer:
    """with StubServer() as s: ... s.url; uvicorn in a thread on a free port."""

    def __init__(self, state: StubState | None = None):
        self.state = state or StubState()

    def __enter__(self) -> StubServer:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(make_app(self.state), log_level="warning", lifespan="off", ws="none",
                                http="h11", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("stub server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()
