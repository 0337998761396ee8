"""Span attributes of a gateway request, by the OpenTelemetry semantic conventions: HTTP
server spans (`http.*`, `url.*`, `server.*`, `error.type`) and generative AI
(`gen_ai.*`), so that trace backends that know them show a request as what it is.
Pure: dicts from what the request and its answer are."""

from __future__ import annotations

from typing import Any

from moemesh.services.gateway.api import openai_api as api


def http_request(method: str, route: str, scheme: str, server: tuple[str, int] | None, kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {"http.request.method": method, "http.route": route, "url.path": route, "url.scheme": scheme,
                           "gen_ai.operation.name": "chat" if kind == "chat" else "text_completion",
                           "gen_ai.provider.name": "moemesh"}
    if server:
        out["server.address"], out["server.port"] = server[0], server[1]
    return out


def gen_ai_request(req: api.GenerateRequest) -> dict[str, Any]:
    p = req.params
    out: dict[str, Any] = {"gen_ai.request.model": req.model, "gen_ai.request.max_tokens": p.max_tokens,
                           "gen_ai.request.temperature": p.temperature, "gen_ai.request.top_p": p.top_p,
                           "gen_ai.response.id": req.response_id, "gen_ai.response.model": req.model}
    if p.top_k:
        out["gen_ai.request.top_k"] = p.top_k
    if p.seed is not None:
        out["gen_ai.request.seed"] = p.seed
    if req.n != 1:
        out["gen_ai.request.choice.count"] = req.n
    if p.stop:
        out["gen_ai.request.stop_sequences"] = list(p.stop)
    return out


def http_response(status: int) -> dict[str, Any]:
    out: dict[str, Any] = {"http.response.status_code": status}
    if status >= 500:
        out["error.type"] = str(status)
    return out


def gen_ai_usage(input_tokens: int, output_tokens: int, finish: str | None, cached: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"gen_ai.usage.input_tokens": input_tokens, "gen_ai.usage.output_tokens": output_tokens}
    if cached:
        out["gen_ai.usage.cache_read.input_tokens"] = cached
    if finish:
        out["gen_ai.response.finish_reasons"] = [finish]
    return out
