"""The HTTP surface: OpenAI-compatible routes on Starlette.

Request lifecycle at the gateway:
1. parsed and validated (400 naming the parameter), model checked (404), context
   length checked (400 with the numbers), admitted by its priority class (admission/:
   it may wait for an in-flight slot behind better classes and earlier arrivals; 429
   with Retry-After when the queue is full, or no slot came within the wait);
2. routed (mesh/client.py with routing/router.py): a decode worker and a KV-aware prefill
   worker are chosen and the job sent to that prefill worker; when it does not answer,
   to the prefill queue group (503 when no worker is alive or takes it);
3. streamed: the request's Handle (streaming/choices.py) collects the token ids the mesh
   client hands it, and its response (there too, for every n) detokenizes them into SSE
   chunks, or gathers them into one answer;
4. closed through the handle, exactly once: finished, or aborted on the workers (a
   stop string, the inactivity timeout, the client gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson
from opentelemetry import trace
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from moemesh.services.gateway.admission.gate import Gate, Refused
from moemesh.services.gateway.api import openai_api as api
from moemesh.services.gateway.api import span_attrs as attrs
from moemesh.services.gateway.api import tokenize as tokenizer_api
from moemesh.services.gateway.api.openapi import openapi_document
from moemesh.services.gateway.config import GatewayConfig
from moemesh.services.gateway.http.auth import ApiKeyMiddleware, load_api_keys
from moemesh.services.gateway.http.server import EventStream, disconnected, read_body
from moemesh.services.gateway.mesh.client import MeshClient, NoWorkers, Rejected
from moemesh.services.gateway.streaming import choices
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.service.metrics_http import MetricsServer
from moemesh.shared.telemetry.metrics import REQUEST_LATENCY_BUCKETS, Metrics
from moemesh.shared.telemetry.tracing import (
    extract_context, get_tracer, inject_headers, setup_tracing, shutdown as shutdown_tracing,
)
from moemesh.shared.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class GatewayState:
    cfg: GatewayConfig
    mesh: MeshClient
    tok: Tokenizer
    max_model_len: int
    tracer: Any
    metrics: Metrics
    vocab_size: int = 0
    openapi: dict = field(default_factory=dict)
    draining: bool = False
    m: dict = field(default_factory=dict)
    gate: Gate | None = None  # the in-flight slots and their queue; built from cfg when not given
    # cfg.model_name, read once here: every request checks its model against it
    model_name: str = field(init=False, default="")

    def __post_init__(self):
        self.model_name = self.cfg.model_name
        if self.gate is None:
            c = self.cfg
            self.gate = Gate(c.max_inflight, c.admission_queue, c.admission_wait_s, c.admission_reserve,
                             c.admission_reserve_below)

    @property
    def inflight(self) -> int:
        return self.gate.inflight


def build_app(cfg: GatewayConfig, gateway_id: str | None = None) -> Starlette:
    api_keys = load_api_keys(cfg.api_keys, cfg.api_keys_file)
    # metrics_port >= 0 moves /metrics off the public port to its own (internal) address.
    separate_metrics = cfg.metrics_port >= 0

    @asynccontextmanager
    async def lifespan(app: Starlette):
        provider = setup_tracing("moemesh-gateway", cfg.trace_file or None, cfg.otlp_endpoint or None)
        st = await _start(cfg, gateway_id, provider)
        app.state.gw = st
        if cfg.decode_only_bench:
            log.warning("BENCH MODE: decode-only; requests skip prefill and get dummy KV. Outputs are meaningless.")
        if not api_keys and cfg.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("no API keys set and listening on %s: the API is open to anyone who can reach it", cfg.host)
        metrics_http = await _serve_metrics(st) if separate_metrics else None
        try:
            yield {"gw": st}
        finally:
            if metrics_http is not None:
                await metrics_http.close()
            await st.mesh.close()
            shutdown_tracing(provider)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/health/ready", ready, methods=["GET"]),
            *([] if separate_metrics else [Route("/metrics", metrics_route, methods=["GET"])]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        middleware=[Middleware(ApiKeyMiddleware, keys=api_keys)] if api_keys else [],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, api.ApiError: _api_error},
    )


def context_length(asked: int, model_positions: int, allow_long: bool) -> int:
    """The context the gateway admits: the one asked for (0: the model's), never past the
    model's positions unless allow_long (a mesh of mock engines, which compute nothing and
    so serve any length)."""
    if not asked:
        return model_positions
    if asked > model_positions and not allow_long:
        log.warning("max_model_len=%d is past the model's %d positions: using %d (allow_long_max_model_len "
                    "lifts this, for mock engines only)", asked, model_positions, model_positions)
        return model_positions
    return asked


async def _start(cfg: GatewayConfig, gateway_id: str | None, provider) -> GatewayState:
    """The gateway's state, its mesh client connected."""
    tok = Tokenizer(cfg.model)
    mcfg = ModelConfig.from_dir(cfg.model)
    metrics = Metrics(const_labels={"model_name": cfg.model_name})
    mesh = MeshClient(cfg, gateway_id, metrics)
    await mesh.start()
    max_model_len = context_length(cfg.max_model_len, mcfg.max_position_embeddings, cfg.allow_long_max_model_len)
    st = GatewayState(cfg, mesh, tok, max_model_len, get_tracer(provider, "moemesh.gateway", root=True), metrics,
                      mcfg.vocab_size, openapi_document(cfg.model_name, mcfg.vocab_size, max_model_len, cfg.max_n,
                                                        cfg.max_prompts))
    st.m = {
        "requests": metrics.counter("requests_total", "HTTP requests by route and status", ("route", "status")),
        "ttft": metrics.histogram("ttft_seconds", "time to first token", buckets=REQUEST_LATENCY_BUCKETS),
        "e2e": metrics.histogram("request_seconds", "request latency, end to end", buckets=REQUEST_LATENCY_BUCKETS),
        "itl": metrics.histogram("inter_token_latency_seconds",
                                 "a streamed request's mean gap between tokens after the first (one per request)"),
        "tokens": metrics.counter("output_tokens_total", "tokens streamed to clients"),
        "inflight": metrics.gauge("inflight_requests", "admitted requests in flight"),
        "admission_wait": metrics.histogram("admission_wait_seconds",
                                            "an admitted request's wait for an in-flight slot (those that waited)",
                                            buckets=REQUEST_LATENCY_BUCKETS),
    }
    metrics.gauge("admission_queue_requests", "requests waiting for an in-flight slot").set_function(
        lambda: st.gate.num_waiting)
    return st


async def _serve_metrics(st: GatewayState) -> MetricsServer:
    """/metrics and health on their own address, off the public port."""
    server = MetricsServer(st.metrics, lambda: {"status": "ok", **_readiness(st)}, st.cfg.metrics_host,
                           st.cfg.metrics_port)
    await server.start()
    log.info("metrics on http://%s:%d/metrics", st.cfg.metrics_host, server.port)
    return server


def _state(request: Request) -> GatewayState:
    return request.app.state.gw


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    err = api.ApiError(exc.status_code, exc.detail or "error", type_="invalid_request_error")
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)  # 405 keeps its Allow


async def _api_error(request: Request, exc: api.ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def _generate(request: Request, kind: str) -> Response:
    """Every way out of a request, bad input and bugs included, is counted once and gives
    back its in-flight slot: `done` runs on each path, at most once."""
    st = _state(request)
    route = request.scope["path"]
    ctx = extract_context(request.headers)
    span = st.tracer.start_span(f"POST {route}", context=ctx, kind=trace.SpanKind.SERVER)
    if span.is_recording():
        span.set_attributes(attrs.http_request("POST", route, request.url.scheme, request.scope.get("server"), kind))
    t0 = time.perf_counter()
    try:
        req = await _admit(request, st, kind, span)
    except Exception as e:
        raise _refused(st, route, span, e) from None
    done = _admitted(st, route, span, t0)
    handle = None
    try:
        headers = inject_headers(context=trace.set_span_in_context(span))
        if len(req.prompts) > 1:  # a completion's batch: every prompt's choices, read as one
            handle = await st.mesh.submit_batch(req.request_id, req.prompts, req.params, headers, req.n)
        elif req.n == 1:
            handle = await st.mesh.submit(req.request_id, req.prompt_ids, req.params, headers)
        else:  # one handle per choice, read as one (streaming/choices.py)
            handle = await st.mesh.submit_choices(req.request_id, req.prompt_ids, req.params, headers, req.n)
        span.set_attribute("decode.id", handle.decode_id)
        if req.stream:
            return EventStream(choices.sse(st, req, handle, span, t0, done), handle, _headers(st, req, handle))
        return await choices.collect(request, st, req, handle, span, t0, done, _headers(st, req, handle))
    except NoWorkers as e:
        done(503)
        raise api.ApiError(503, str(e), type_="service_unavailable", code="no_workers",
                           headers={"Retry-After": str(st.cfg.retry_after_s)}) from None
    except Rejected as e:
        done(400)
        raise api.ApiError(400, str(e)) from None
    except BaseException as e:
        gone = isinstance(e, asyncio.CancelledError)
        if handle is not None:
            handle.close("client" if gone else "error")
        done(499 if gone else 500)
        if isinstance(e, Exception):
            raise _internal(e, "serving a request") from None
        raise


def _refused(st: GatewayState, route: str, span, e: Exception) -> api.ApiError:
    """A request that was not admitted (bad input, or a bug on the way): counted, its span
    ended. Returns the error the client gets."""
    err = e if isinstance(e, api.ApiError) else _internal(e, "admitting a request")
    span.set_status(trace.StatusCode.ERROR, err.message)
    if span.is_recording():
        span.set_attribute("http.status_code", err.status)
        span.set_attributes(attrs.http_response(err.status))
    span.end()
    st.m["requests"].labels(route, str(err.status)).inc()
    return err


def _admitted(st: GatewayState, route: str, span, t0: float) -> Callable[[int], None]:
    """For a request that holds an in-flight slot (_admit took it). Returns done(status),
    its one way out: the slot given back, the request counted and timed, its span ended,
    once."""
    st.m["inflight"].set(st.inflight)
    handle_done = asyncio.Event()

    def done(status: int) -> None:
        if handle_done.is_set():
            return
        handle_done.set()
        st.gate.release()
        st.m["inflight"].set(st.inflight)
        st.m["requests"].labels(route, str(status)).inc()
        st.m["e2e"].observe(time.perf_counter() - t0)
        if span.is_recording():
            span.set_attribute("http.status_code", status)
            span.set_attributes(attrs.http_response(status))
        span.end()

    return done


def _internal(e: Exception, doing: str) -> api.ApiError:
    """A bug, not the client's fault: logged in full here, and a 500 that names nothing
    internal to the client."""
    log.exception("internal error %s", doing)
    return api.ApiError(500, "internal server error", type_="server_error", code="internal_error")


async def _admit(request: Request, st: GatewayState, kind: str, span) -> api.GenerateRequest:
    if st.draining:
        raise api.ApiError(503, "gateway is shutting down", type_="service_unavailable",
                           headers={"Retry-After": str(st.cfg.retry_after_s)})
    if st.gate.hopeless():  # before reading and tokenizing what would be refused whatever its class
        raise _at_capacity(st, "full")
    raw = await read_body(request, st.cfg.max_body_bytes, st.cfg.body_timeout_s)
    header = request.headers.get(api.PRIORITY_HEADER)
    if len(raw) > st.cfg.inline_parse_bytes:
        req = await asyncio.to_thread(_parse, raw, st, kind, header)
    else:
        req = _parse(raw, st, kind, header)
    if req.model != st.model_name:
        raise api.ApiError(404, f"model {req.model!r} does not exist; this server serves {st.model_name!r}",
                           "model", code="model_not_found")
    n, m = max(map(len, req.prompts)), req.params.max_tokens
    if n + m > st.max_model_len:
        raise api.ApiError(400, f"This model's maximum context length is {st.max_model_len} tokens. However, you "
                                f"requested {n + m} tokens ({n} in the prompt, {m} for the completion).",
                           "messages" if kind == "chat" else "prompt", code="context_length_exceeded")
    span.set_attributes({"request.id": req.request_id, "prompt.tokens": sum(map(len, req.prompts)), "max_tokens": m,
                         "stream": req.stream, "request.priority": req.params.priority})
    if span.is_recording():
        span.set_attributes(attrs.gen_ai_request(req))
        span.set_attributes(req.trace_attrs)
    try:  # the last step: from here the slot is the request's, given back by done()
        waited = await st.gate.enter(req.params.priority, lambda: disconnected(request.receive))
    except Refused as e:
        raise _not_admitted(st, e.reason) from None
    if waited:
        st.m["admission_wait"].observe(waited)
    return req


def _parse(raw: bytes, st: GatewayState, kind: str, priority_header: str | None) -> api.GenerateRequest:
    body = _loads(raw)
    if kind == "chat":
        return api.parse_chat(body, st.tok, st.cfg.default_max_tokens, st.vocab_size, st.cfg.max_n, priority_header)
    return api.parse_completion(body, st.tok, st.cfg.default_max_tokens, st.vocab_size, st.cfg.max_n,
                                st.cfg.max_prompts, priority_header)


def _not_admitted(st: GatewayState, reason: str) -> api.ApiError:
    if reason == "closed":
        return api.ApiError(503, "gateway is shutting down", type_="service_unavailable",
                            headers={"Retry-After": str(st.cfg.retry_after_s)})
    if reason == "gone":  # nobody reads this answer; the status is for the count
        return api.ApiError(499, "client closed the request while it waited for admission")
    return _at_capacity(st, reason)


def _at_capacity(st: GatewayState, reason: str) -> api.ApiError:
    """The 429 of a request not admitted for want of a slot, saying why (gate.Refused)."""
    cfg = st.cfg
    msg = f"server is at capacity ({cfg.max_inflight} requests in flight"
    if reason == "full":
        msg += f", {cfg.admission_queue} waiting of this priority or better)" if cfg.admission_queue else ")"
    elif reason == "waited":
        msg += f"): no slot freed within the admission wait ({cfg.admission_wait_s:g} s)"
    else:
        msg += "): a request of a better priority took this one's place in the admission queue"
    return api.ApiError(429, msg, type_="rate_limit_error", code="capacity",
                        headers={"Retry-After": str(cfg.retry_after_s)})


def _headers(st: GatewayState, req: api.GenerateRequest, handle) -> dict[str, str]:
    if st.cfg.worker_header:  # opt-in, for benchmarks: it names an internal worker
        return {"x-request-id": req.request_id, "x-moemesh-worker": handle.decode_id}
    return {"x-request-id": req.request_id}


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_entry(_state(request))]})


async def model(request: Request) -> JSONResponse:
    st = _state(request)
    name = request.path_params["model"]
    if name != st.model_name:
        raise api.ApiError(404, f"The model {name!r} does not exist", "model", code="model_not_found")
    return JSONResponse(_model_entry(st))


def _model_entry(st: GatewayState) -> dict:
    entry = {"id": st.model_name, "object": "model", "created": 0, "owned_by": "moemesh",
             "max_model_len": st.max_model_len}
    engines = sorted({hb.engine for hb in st.mesh.live("decode") + st.mesh.live("prefill")})
    if engines and engines != ["model"]:
        entry["moemesh_engines"] = engines  # a mock engine must never pass for the real model
    if st.cfg.decode_only_bench:
        entry["moemesh_mode"] = "decode-only-bench"
    return entry


def _readiness(st: GatewayState) -> dict:
    n_pre, n_dec = len(st.mesh.live("prefill")), len(st.mesh.live("decode"))
    need_prefill = not st.cfg.decode_only_bench
    out = {"ready": (n_pre > 0 or not need_prefill) and n_dec > 0 and not st.draining,
           "workers": {"prefill": n_pre, "decode": n_dec}, "inflight": st.inflight}
    if st.mesh.instances_down:
        out["instances_down"] = {i: why for i, (why, _) in st.mesh.instances_down.items()}  # back when restarted
    return out


async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the process serves HTTP; readiness is reported alongside."""
    return JSONResponse({"status": "ok", **_readiness(_state(request))})


async def ready(request: Request) -> JSONResponse:
    r = _readiness(_state(request))
    return JSONResponse({"status": "ready" if r["ready"] else "not_ready", **r}, status_code=200 if r["ready"] else 503)


async def metrics_route(request: Request) -> Response:
    body, ctype = _state(request).metrics.render()
    return Response(body, media_type=ctype)


async def tokenize(request: Request) -> JSONResponse:
    st = _state(request)
    body = await _json_body(request, st)
    if len(body) > st.cfg.inline_parse_bytes:  # a long text is tokenized off the event loop
        return JSONResponse(await asyncio.to_thread(_tokenize, body, st))
    return JSONResponse(_tokenize(body, st))


def _tokenize(raw: bytes, st: GatewayState) -> dict:
    return tokenizer_api.tokenize(_loads(raw), st.tok, st.model_name, st.max_model_len)


async def detokenize(request: Request) -> JSONResponse:
    st = _state(request)
    body = _loads(await _json_body(request, st))
    return JSONResponse(tokenizer_api.detokenize(body, st.tok, st.model_name, st.vocab_size))


async def tokenizer_info(request: Request) -> JSONResponse:
    return JSONResponse(tokenizer_api.tokenizer_info(_state(request).tok))


async def _json_body(request: Request, st: GatewayState) -> bytes:
    return await read_body(request, st.cfg.max_body_bytes, st.cfg.body_timeout_s)


def _loads(raw: bytes):
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise api.ApiError(400, f"request body is not valid JSON: {e}") from None


async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(_state(request).openapi)
