"""The OpenAPI document served at /openapi.json: every field the gateway accepts, with
the bounds it checks (openai_api.py, shared/protocol/messages.py), and the model it serves.
A request the document allows is one the gateway takes, short of what depends on the
prompt's length in tokens (the context length) or on load (429, 503). Optional fields
may be null, which means "the default", as the parser treats them."""

from __future__ import annotations

from moemesh.shared.protocol.messages import INT32_MAX, INT64, PRIORITY_MAX, PRIORITY_MIN

_ERROR = {"$ref": "#/components/schemas/Error"}
_PRIORITY = ("extension (vLLM's): the request's class; lower is served earlier (admission, the prefill queue, "
             "preemption), then by arrival; default 0")
# The same class as a header, for clients that cannot add a body field; the field wins.
_PRIORITY_HEADER = {"name": "x-request-priority", "in": "header", "required": False,
                    "schema": {"type": "integer", "minimum": PRIORITY_MIN, "maximum": PRIORITY_MAX},
                    "description": "the request's priority when the body has none (a body's priority wins)"}
_CONTEXT = ("prompt tokens plus this must fit the model's context (max_model_len); a request that does not "
            "is a 400 with code context_length_exceeded")


def _opt(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _int(lo: int, hi: int, **kw) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi, **kw}


_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_UNENFORCEABLE = ("a JSON Schema; one the grammar library cannot enforce (an unknown type, an unsupported keyword) "
                  "is a 400 with code unenforceable_schema")
_RESPONSE_FORMAT = {"oneOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": _NAME, "strict": _opt({"type": "boolean"}),
            "schema": _opt({"type": "object", "description": _UNENFORCEABLE})}}}},
], "description": "structured output, enforced while sampling (docs/structured_outputs.md)"}
_MISMATCH = ("a tool_choice naming a function not in tools, or two tools of one name, is a 400 with code "
             "tool_mismatch")
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _NAME, "description": _opt({"type": "string"}), "strict": _opt({"type": "boolean"}),
        "parameters": _opt({"type": "object", "description": _UNENFORCEABLE + " (when tool_choice forces a call)"})}}}}
_TOOLS = {
    "tools": _opt({"type": "array", "items": _TOOL, "description": "with n above 1 each choice answers in text or "
                   "in tool calls of its own (a forced call holds for every choice); " + _MISMATCH}),
    "tool_choice": _opt({"oneOf": [
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": _NAME}}}}]}),
    "parallel_tool_calls": _opt({"type": "boolean"}),
}
# A call that tool_choice forces (required, or a named function) needs a tool to call, and
# no response_format grammar beside its own: tool_calls.parse_tools, openai_api._grammar.
_FORCED_CALL = {"anyOf": [
    {"properties": {"tool_choice": _opt({"enum": ["none", "auto"]})}},
    {"required": ["tools"], "properties": {
        "tools": {"type": "array", "minItems": 1},
        "response_format": _opt({"type": "object", "properties": {"type": {"const": "text"}}})}},
]}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string"}}}}}


def _sampling(max_tokens_key: str, max_model_len: int, max_n: int) -> dict:
    return {
        "n": _opt(_int(1, max_n, description="choices, sampled from one prefill of the prompt")),
        max_tokens_key: _opt(_int(1, max_model_len, description=_CONTEXT)),
        "temperature": _opt({"type": "number", "minimum": 0, "maximum": 100}),
        "top_p": _opt({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _opt(_int(-INT32_MAX, INT32_MAX, description="extension; 0 or below disables it")),
        "seed": _opt(_int(*INT64)),
        "stop": _opt({"oneOf": [{"type": "string", "minLength": 1},
                                {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16}]}),
        "stream": _opt({"type": "boolean"}),
        "stream_options": _opt({"type": "object", "additionalProperties": False, "properties": {
            "include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}}),
        "ignore_eos": _opt({"type": "boolean", "description": "extension"}),
        "add_special_tokens": _opt({"type": "boolean", "description": "extension (vLLM's): the tokenizer's own "
                                                                     "special tokens (BOS); default true for a prompt, "
                                                                     "false for messages (the template writes them)"}),
        "return_tokens_as_token_ids": _opt({"type": "boolean", "description": "extension (vLLM's): logprobs name "
                                                                             "each token \"token_id:<id>\""}),
        "min_tokens": _opt(_int(0, INT32_MAX, description=f"extension; at most {max_tokens_key}")),
        "priority": _opt(_int(PRIORITY_MIN, PRIORITY_MAX, description=_PRIORITY)),
        "stop_token_ids": _opt({"type": "array", "items": _int(0, INT32_MAX), "maxItems": 1024,
                                "description": "extension"}),
        # Accepted only at the one value this server honours (openai_api.UNSUPPORTED).
        "best_of": _opt({"const": 1}),
        "presence_penalty": _opt({"const": 0}),
        "frequency_penalty": _opt({"const": 0}),
        "suffix": {"type": "null"},
        "functions": {"type": "null"},
        "function_call": {"type": "null"},
        "logit_bias": {"type": "null"},
        **{k: {"type": "null"} for k in ("audio", "prediction", "reasoning_effort", "verbosity",
                                         "web_search_options", "moderation", "prompt_cache_key",
                                         "prompt_cache_options", "prompt_cache_retention")},
        "response_format": _opt(_RESPONSE_FORMAT),
        "user": _opt({"type": "string", "maxLength": 512, "description": "recorded on the request's trace span"}),
    }


# Chat only: what describes the caller (recorded on the trace) and the values that mean
# what this server does (openai_api.py).
_CALLER = {
    "safety_identifier": _opt({"type": "string", "maxLength": 512, "description": "recorded on the trace span"}),
    "metadata": _opt({"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                      "additionalProperties": {"type": "string", "maxLength": 512},
                      "description": "recorded on the trace span"}),
    "store": _opt({"const": False}),
    "service_tier": _opt({"enum": ["auto", "default"]}),
    "modalities": _opt({"type": "array", "const": ["text"]}),
}


def _errors(*codes: int) -> dict:
    return {str(c): {"description": d, "content": {"application/json": {"schema": _ERROR}}}
            for c, d in ((400, "bad parameter or context too long"), (404, "unknown model"),
                         (408, "the body did not arrive in time"), (413, "body too large"),
                         (429, "at capacity: the admission queue is full, or no slot freed within the wait; see "
                                "Retry-After"), (500, "internal error"),
                         (503, "no worker alive; see Retry-After"))
            if c in codes}


# One server-sent event: its data is a JSON chunk, then the last is the string [DONE].
_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] at the end"},
                   "event": {"type": "string"}}}}}
_POST_ERRORS = _errors(400, 404, 408, 413, 429, 500, 503)


# A chat message, as openai_api._message reads it.
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"oneOf": [{"type": "string"},
                          {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
                              "type": {"const": "text"}, "text": {"type": "string"}}}},
                          {"type": "null"}]},
    "tool_calls": {"type": "array", "items": _TOOL_CALL, "description": "an assistant turn's calls"},
    "tool_call_id": {"type": "string", "description": "a tool result's call"}}}


def _completion(model: dict, vocab_size: int, max_model_len: int, max_n: int, max_prompts: int) -> dict:
    ids = {"type": "array", "minItems": 1, "items": _int(0, vocab_size - 1)}
    batch = "a batch: each prompt is a request of its own, choice p * n + i being prompt p's i-th"
    sampling = _sampling("max_tokens", max_model_len, max_n)
    sampling["max_tokens"] = _opt(_int(0, max_model_len, description=_CONTEXT + "; 0 with echo only: the prompt "
                                       "scored (echo with logprobs), nothing generated"))
    return {"type": "object", "required": ["model", "prompt"], "additionalProperties": False, "properties": {
        "model": model,
        "prompt": {"oneOf": [{"type": "string"}, ids,
                             {"type": "array", "minItems": 1, "maxItems": max_prompts, "items": {"type": "string"},
                              "description": batch},
                             {"type": "array", "minItems": 1, "maxItems": max_prompts, "items": ids,
                              "description": batch}]},
        "logprobs": _opt(_int(0, 20, description="with echo, the prompt's tokens too (the first one's null)")),
        "echo": _opt({"type": "boolean", "description": "the prompt comes back before the completion"}),
        "prompt_logprobs": _opt(_int(0, 20, description="extension (vLLM's): each prompt token's logprob and rank "
                                     "with this many alternatives, in choices[].prompt_logprobs")),
        **sampling,
        **{k: {"type": "null", "description": "chat only"} for k in _TOOLS}},
        # max_tokens 0 asks for the prompt alone: it needs echo
        "allOf": [{"if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
                   "then": {"required": ["echo"], "properties": {"echo": {"const": True}}}}]}


# A completion's logprobs: OpenAI's legacy arrays, and vLLM's prompt_logprobs (completion_logprobs.py).
_LEGACY_LOGPROBS = {"type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
                    "properties": {
                        "tokens": {"type": "array", "items": {"type": "string"}},
                        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
                        "top_logprobs": {"type": "array", "items": {"anyOf": [
                            {"type": "object", "additionalProperties": {"type": "number"}}, {"type": "null"}]}},
                        "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}
_PROMPT_LOGPROB = {"type": "object", "required": ["logprob", "rank", "decoded_token"], "properties": {
    "logprob": {"type": "number"}, "rank": {"type": "integer", "minimum": 1}, "decoded_token": {"type": "string"}}}
_COMPLETION_RESPONSE = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "object": {"const": "text_completion"},
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "text", "finish_reason"],
                                           "properties": {
        "index": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
        "logprobs": _opt(_LEGACY_LOGPROBS),
        "prompt_logprobs": {"type": "array", "description": "the first prompt token's is null",
                            "items": {"anyOf": [{"type": "null"}, {"type": "object", "propertyNames": {
                                "pattern": "^[0-9]+$"}, "additionalProperties": _PROMPT_LOGPROB}]}}}}}}}

_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}}


def _chat(model: dict, max_model_len: int, max_n: int) -> dict:
    return {"type": "object", "required": ["model", "messages"], "additionalProperties": False, "properties": {
        "model": model,
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "logprobs": _opt({"type": "boolean"}),
        "top_logprobs": _opt(_int(0, 20)),
        **_sampling("max_completion_tokens", max_model_len, max_n), **_TOOLS, **_CALLER,
        "max_tokens": _opt(_int(1, max_model_len, description="used when max_completion_tokens is absent"))},
        **_FORCED_CALL}


def _post(summary: str, op: str, schema: dict, response: dict | None = None) -> dict:
    return {"post": {
        "summary": summary, "operationId": op, "parameters": [_PRIORITY_HEADER],
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": {"description": "the completion, or an SSE stream when stream is true",
                              "content": {"application/json": {"schema": response or {"type": "object"}},
                                          **_STREAM}},
                      **_POST_ERRORS}}}


def _tokenizer_paths(model: dict, vocab_size: int) -> dict:
    """/tokenize, /detokenize and /tokenizer_info, in vLLM's shapes (tokenize.py)."""
    flag = _opt({"type": "boolean"})
    tokenize = {"type": "object", "additionalProperties": False,
                "oneOf": [{"required": ["prompt"], "not": {"anyOf": [{"required": ["messages"]},
                                                                      {"required": ["add_generation_prompt"]}]}},
                          {"required": ["messages"], "not": {"required": ["prompt"]}}], "properties": {
                    "model": _opt(model), "prompt": {"type": "string"},
                    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE,
                                 "description": "rendered by the chat template, then tokenized"},
                    "add_special_tokens": {**flag, "description": "default true for a prompt, false for messages"},
                    "add_generation_prompt": {**flag, "description": "messages only; default true"},
                    "return_token_strs": flag}}
    detokenize = {"type": "object", "required": ["tokens"], "additionalProperties": False, "properties": {
        "model": _opt(model), "tokens": {"type": "array", "items": _int(0, vocab_size - 1)}}}
    errors = _errors(400, 404, 408, 413, 500)

    def post(summary: str, op: str, schema: dict, response: dict) -> dict:
        return {"post": {"summary": summary, "operationId": op,
                         "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                         "responses": {"200": {"description": "ok", "content": {"application/json": {
                             "schema": response}}}, **errors}}}

    return {
        "/tokenize": post("Tokenize a prompt or a chat", "tokenize", tokenize, {
            "type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"], "properties": {
                "count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer"}, "tokens": _TOKENS,
                "token_strs": _opt({"type": "array", "items": {"type": "string"}})}}),
        "/detokenize": post("Token ids to text", "detokenize", detokenize, {
            "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}),
        "/tokenizer_info": {"get": {"summary": "The tokenizer's configuration and chat template",
                                    "operationId": "tokenizerInfo", "responses": {"200": {
                                        "description": "tokenizer_config.json's settings, tokenizer_class, "
                                                       "chat_template", "content": {"application/json": {"schema": {
                                            "type": "object", "required": ["tokenizer_class"]}}}}}}},
    }


def openapi_document(model_name: str, vocab_size: int, max_model_len: int, max_n: int = 1,
                     max_prompts: int = 64) -> dict:
    model = {"type": "string", "enum": [model_name]}
    return {
        "openapi": "3.1.0",
        "info": {"title": "moemesh gateway", "version": "0.1.0",
                 "description": "OpenAI-compatible completions over a disaggregated MoE serving mesh."},
        "paths": {
            "/v1/completions": _post("Text completion", "createCompletion",
                                     _completion(model, vocab_size, max_model_len, max_n, max_prompts),
                                     _COMPLETION_RESPONSE),
            "/v1/chat/completions": _post("Chat completion", "createChatCompletion", _chat(model, max_model_len, max_n)),
            "/v1/models": {"get": {"summary": "Served models", "operationId": "listModels",
                                   "responses": {"200": {"description": "model list"}}}},
            "/v1/models/{model}": {"get": {
                "summary": "One served model", "operationId": "retrieveModel",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string", "enum": [model_name]}}],
                "responses": {"200": {"description": "the model"},
                              "404": {"description": "no such model", "content": {"application/json": {
                                  "schema": {"$ref": "#/components/schemas/Error"}}}}}}},
            "/health": {"get": {"summary": "Liveness, with readiness details",
                                "responses": {"200": {"description": "alive"}}}},
            "/health/ready": {"get": {"summary": "Readiness: a prefill and a decode worker are alive",
                                      "responses": {"200": {"description": "ready"},
                                                    "503": {"description": "not ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "text format"}}}},
            **_tokenizer_paths(model, vocab_size),
        },
        "components": {"schemas": {"Error": {"type": "object", "properties": {"error": {
            "type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                             "param": {"type": ["string", "null"]},
                                             "code": {"type": ["string", "null"]}}}}}}},
    }
