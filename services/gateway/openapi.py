"""The OpenAPI document served at /openapi.json."""

from __future__ import annotations

_ERROR = {"$ref": "#/components/schemas/Error"}
_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 100},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "description": "extension; 0 disables"},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 16}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "ignore_eos": {"type": "boolean", "description": "extension"},
    "min_tokens": {"type": "integer", "minimum": 0, "description": "extension"},
    "stop_token_ids": {"type": "array", "items": {"type": "integer"}, "description": "extension"},
    "n": {"type": "integer", "enum": [1]},
}


def _errors(*codes: int) -> dict:
    return {str(c): {"description": d, "content": {"application/json": {"schema": _ERROR}}}
            for c, d in ((400, "bad parameter or context too long"), (404, "unknown model"),
                         (429, "at capacity; see Retry-After"), (503, "no worker alive; see Retry-After"))
            if c in codes}


_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "data: {chunk}\\n\\n ... data: [DONE]"}}}

OPENAPI = {
    "openapi": "3.1.0",
    "info": {"title": "moemesh gateway", "version": "0.1.0",
             "description": "OpenAI-compatible completions over a disaggregated MoE serving mesh."},
    "paths": {
        "/v1/completions": {"post": {
            "summary": "Text completion", "operationId": "createCompletion",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["model", "prompt"],
                "properties": {"model": {"type": "string"},
                               "prompt": {"oneOf": [{"type": "string"},
                                                    {"type": "array", "items": {"type": "integer"}}]},
                               "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}, **_SAMPLING}}}}},
            "responses": {"200": {"description": "completion, or an SSE stream when stream=true",
                                  "content": {"application/json": {"schema": {"type": "object"}}, **_STREAM}},
                          **_errors(400, 404, 429, 503)}}},
        "/v1/chat/completions": {"post": {
            "summary": "Chat completion", "operationId": "createChatCompletion",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["model", "messages"],
                "properties": {"model": {"type": "string"},
                               "messages": {"type": "array", "minItems": 1, "items": {
                                   "type": "object", "required": ["role", "content"],
                                   "properties": {"role": {"enum": ["system", "developer", "user", "assistant",
                                                                    "tool"]},
                                                  "content": {"type": "string"}}}},
                               "max_completion_tokens": {"type": "integer", "minimum": 1},
                               "logprobs": {"type": "boolean"},
                               "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}, **_SAMPLING}}}}},
            "responses": {"200": {"description": "chat completion, or an SSE stream when stream=true",
                                  "content": {"application/json": {"schema": {"type": "object"}}, **_STREAM}},
                          **_errors(400, 404, 429, 503)}}},
        "/v1/models": {"get": {"summary": "Served models", "operationId": "listModels",
                               "responses": {"200": {"description": "model list"}}}},
        "/health": {"get": {"summary": "Liveness, with readiness details",
                            "responses": {"200": {"description": "alive"}}}},
        "/health/ready": {"get": {"summary": "Readiness: a prefill and a decode worker are alive",
                                  "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text format"}}}},
    },
    "components": {"schemas": {"Error": {"type": "object", "properties": {"error": {
        "type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                         "param": {"type": ["string", "null"]},
                                         "code": {"type": ["string", "null"]}}}}}}},
}
