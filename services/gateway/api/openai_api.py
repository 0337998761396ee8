"""The OpenAI-compatible request schema: parsing, validation and response shapes.

Everything a client can get wrong is caught here and raised as ApiError, which the
app turns into OpenAI's error object: {"error": {"message", "type", "param", "code"}}.

Nothing a client sends is silently ignored: a field this server does not read is a 400
naming it, and a field it cannot honour at the value given is a 400 naming it too
(UNSUPPORTED). The fields that describe the caller rather than the answer (`user`,
`safety_identifier`, `metadata`) are honoured by recording them on the request's trace
span; `store`, `service_tier` and `modalities` are honoured at the values that mean what
this server does (nothing stored, one tier, text).
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

from moemesh.services.gateway.api.completion_logprobs import token_text
from moemesh.services.gateway.api.structured import FormatError, grammar_of
from moemesh.services.gateway.api.tool_calls import Delta, ToolCallParser, ToolError, Tools, parse_tools
from moemesh.shared.protocol.messages import (
    INT32_MAX, PRIORITY_MAX, PRIORITY_MIN, GrammarSpec, SamplingParamError, SamplingParams,
)
from moemesh.shared.tokenizer.tokenizer import Tokenizer, TokenizerError


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerateRequest:
    kind: str  # "chat" | "completion"
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's): usage on every chunk
    trace_attrs: dict = field(default_factory=dict)  # the caller's user, safety id and metadata, for the span
    logprobs: int | None = None  # number of alternatives per token, when requested
    # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>", which
    # says which token it was even where its text alone cannot (a byte of a character).
    tokens_as_ids: bool = False
    n: int = 1  # choices, each sampled on its own from the one prompt (shared/protocol/forks.py)
    tools: Tools | None = None  # set when the answer may hold tool calls (chat only)
    request_id: str = field(default_factory=lambda: f"{random.getrandbits(128):032x}")
    created: int = field(default_factory=lambda: int(time.time()))
    # Completions only. A batch of prompts: each is a request of its own (of n choices) and
    # the answer's choice p * n + i is prompt p's i-th; prompt_ids is the first of them.
    prompts: list[list[int]] = field(default_factory=list)
    prompt_texts: list[str | None] = field(default_factory=list)  # as given (None: token ids), for echo
    echo: bool = False  # the prompt comes back before the completion (with its logprobs, if asked)
    generate: bool = True  # False: max_tokens 0 with echo; the prompt is scored and nothing is generated
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many alternatives

    def __post_init__(self):
        if not self.prompts:
            self.prompts = [self.prompt_ids]
        if not self.prompt_texts:
            self.prompt_texts = [None] * len(self.prompts)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id


# The fields read for both endpoints (their vLLM-style extensions included), and each one's own.
_COMMON_FIELDS = frozenset({"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed",
                            "stop", "stop_token_ids", "ignore_eos", "min_tokens", "n", "response_format", "logprobs",
                            "user", "tools", "tool_choice", "parallel_tool_calls", "return_tokens_as_token_ids",
                            "add_special_tokens", "priority"})
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "metadata", "store",
                                "service_tier", "modalities", "safety_identifier"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "prompt_logprobs"}
# Taken at one value only (null, or the value named): each is refused by name otherwise.
UNSUPPORTED = {
    "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "suffix": None,
    "functions": None, "function_call": None, "logit_bias": None, "audio": None, "prediction": None,
    "reasoning_effort": None, "verbosity": None, "web_search_options": None, "moderation": None,
    "prompt_cache_key": None, "prompt_cache_options": None, "prompt_cache_retention": None,
}
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
# The request's class for clients that cannot add a body field (a proxy that sets it by
# route or key): the same integer as the body's `priority`, which wins when both are given.
PRIORITY_HEADER = "x-request-priority"
_HEADER_INT = re.compile(r"[+-]?[0-9]{1,16}")


def _known(body: dict, kind: str) -> None:
    """A field neither endpoint reads is refused, by name."""
    known = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    for name in body:
        if name not in known and name not in UNSUPPORTED:
            raise ApiError(400, f"'{name}' is not a parameter this server takes", name)


def _caller_attributes(body: dict) -> dict[str, Any]:
    """The caller's identifiers and metadata as span attributes; refuses what it cannot honour."""
    out: dict[str, Any] = {}
    for name, attr in (("user", "user.id"), ("safety_identifier", "moemesh.safety_identifier")):
        v = body.get(name)
        if v is not None:
            if not isinstance(v, str) or len(v) > 512:
                raise ApiError(400, f"'{name}' must be a string of at most 512 characters", name)
            out[attr] = v
    meta = body.get("metadata")
    if meta is not None:
        if not (isinstance(meta, dict) and len(meta) <= 16 and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in meta.items())):
            raise ApiError(400, "'metadata' must be an object of at most 16 string values", "metadata")
        out.update({f"moemesh.metadata.{k}": v for k, v in meta.items()})
    if body.get("store") not in (None, False):
        raise ApiError(400, "'store' is not supported by this server: nothing is stored (use false or leave it out)",
                       "store")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise ApiError(400, "'service_tier' must be auto or default: this server has one tier", "service_tier")
    if body.get("modalities") not in (None, ["text"]):
        raise ApiError(400, "'modalities' must be [\"text\"]: this server answers in text only", "modalities")
    return out


def _honoured(v, ok) -> bool:
    """v is ok, compared as JSON compares: true is not 1, and 0.0 is 0."""
    if v is None or (v is ok):
        return True
    if isinstance(ok, bool) or isinstance(v, bool) or ok is None:
        return False
    return isinstance(v, (int, float)) and v == ok


def _get(body: dict, name: str, types: tuple, default=None, *, allow_none: bool = True):
    if name not in body or (body[name] is None and allow_none):
        return default
    v = body[name]
    if int in types and float not in types:
        v = _integral(v)
    if isinstance(v, bool) and bool not in types:
        raise ApiError(400, f"'{name}' must be {_names(types)}, got a boolean", name)
    if not isinstance(v, types):
        raise ApiError(400, f"'{name}' must be {_names(types)}, got {type(v).__name__}", name)
    return v


def _integral(v):
    """JSON has one number type: 3.0 is the integer 3 (as JSON Schema says), 3.5 is not."""
    if not (isinstance(v, float) and v.is_integer()):
        return v
    # orjson reads an integer literal outside [-2^63, 2^64) as the nearest float, so
    # -2^63 - 1 arrives as exactly -2^63. A float that far out stands for an integer we
    # cannot know, past every range here: one step further out, the field's own range
    # check refuses it (and -9223372036854775808.0, which we cannot tell apart, with it).
    return int(v) - 1 if v <= _ORJSON_MIN_INT else int(v)


_ORJSON_MIN_INT = -(1 << 63)


def _ints(vs: list) -> list:
    return [_integral(v) for v in vs]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _names(types: tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
             dict: "an object"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


def _n(body: dict, max_n: int) -> int:
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= max_n:
        raise ApiError(400, f"'n' must be in [1, {max_n}] on this server, got {n}", "n")
    return n


def _common(body: dict, default_max_tokens: int, max_key: str = "max_tokens",
            grammar: GrammarSpec | None = None, priority_header: str | None = None) -> tuple[SamplingParams, dict]:
    """What completions and chat share: the sampling parameters and the stream options.
    grammar: a constraint the caller built (forced tool calls). priority_header: the
    request's x-request-priority, if it came with one. The fields are checked in one
    order, so that a body with several faults always gets the same 400."""
    _unsupported(body)
    trace_attrs = _caller_attributes(body)
    grammar = _grammar(body, grammar)
    stop = _stop(body)
    stream_opts = _stream_options(body)
    max_tokens, min_tokens = _token_limits(body, default_max_tokens, max_key)
    priority = _priority(body, priority_header)
    params = replace(_sampling(body, max_key, max_tokens, min_tokens, stop, grammar), priority=priority)
    return params, {"stream": _get(body, "stream", (bool,), False),
                    "include_usage": stream_opts.get("include_usage", False),
                    "continuous_usage": stream_opts.get("continuous_usage_stats", False), "trace_attrs": trace_attrs,
                    "tokens_as_ids": _get(body, "return_tokens_as_token_ids", (bool,), False)}


def _priority(body: dict, header: str | None) -> int:
    """The request's class (vLLM's `priority`: lower is served earlier, 0 by default): the
    body's field, else the header's. A header that came is checked even when the field wins:
    a malformed one is a client's mistake either way."""
    from_header = 0
    if header is not None:
        h = header.strip()
        if not _HEADER_INT.fullmatch(h) or not PRIORITY_MIN <= int(h) <= PRIORITY_MAX:
            raise ApiError(400, f"header '{PRIORITY_HEADER}' must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] "
                                f"(lower is served earlier), got {header[:32]!r}", PRIORITY_HEADER)
        from_header = int(h)
    v = _get(body, "priority", (int,), from_header)
    if not PRIORITY_MIN <= v <= PRIORITY_MAX:
        raise ApiError(400, f"'priority' must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower is served "
                            f"earlier), got {v}", "priority")
    return v


def _unsupported(body: dict) -> None:
    for name, ok in UNSUPPORTED.items():
        if name in body and not _honoured(body[name], ok):
            raise ApiError(400, f"'{name}' is not supported by this server (use {ok!r} or leave it out)", name)


def _grammar(body: dict, grammar: GrammarSpec | None) -> GrammarSpec | None:
    """The caller's grammar, or response_format's; the two together are refused."""
    if body.get("response_format") is None:  # plain text, as grammar_of(None) says
        return grammar
    try:
        fmt = grammar_of(body["response_format"])
    except FormatError as e:
        raise ApiError(400, f"'response_format' {e}", "response_format", code=e.code) from None
    if fmt is not None and grammar is not None:
        raise ApiError(400, "'response_format' cannot be combined with a tool_choice that forces a tool call",
                       "response_format", code="tool_mismatch")
    return grammar or fmt


def _stop(body: dict) -> list[str]:
    stop = _get(body, "stop", (str, list), [])
    if isinstance(stop, str):
        stop = [stop]
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a string or an array of non-empty strings", "stop")
    return stop


def _stream_options(body: dict) -> dict:
    stream_opts = _get(body, "stream_options", (dict,), {})
    for k, v in stream_opts.items():
        if k not in STREAM_OPTIONS:
            raise ApiError(400, f"'stream_options.{k}' is not supported by this server (it takes "
                                f"{' and '.join(STREAM_OPTIONS)})", "stream_options")
        if not isinstance(v, bool):
            raise ApiError(400, f"'stream_options.{k}' must be a boolean", "stream_options")
    return stream_opts


def _token_limits(body: dict, default_max_tokens: int, max_key: str) -> tuple[Any, int]:
    """(max_tokens, min_tokens). max_key: the name the endpoint reads first; chat falls back
    to max_tokens. SamplingParams checks max_tokens itself."""
    max_tokens = _get(body, max_key, (int,), None)
    if max_key != "max_tokens":  # checked even when max_completion_tokens wins over it
        legacy = _get(body, "max_tokens", (int,), None)
        if legacy is not None and not 1 <= legacy <= INT32_MAX:
            raise ApiError(400, f"'max_tokens' must be in [1, {INT32_MAX}]", "max_tokens")
        max_tokens = legacy if max_tokens is None else max_tokens
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    min_tokens = _get(body, "min_tokens", (int,), 0)
    if not 0 <= min_tokens <= INT32_MAX:
        raise ApiError(400, f"'min_tokens' must be in [0, {INT32_MAX}]", "min_tokens")
    if _is_int(max_tokens):
        min_tokens = min(min_tokens, max_tokens)  # "at least n, but no more than max_tokens"
    return max_tokens, min_tokens


def _sampling(body: dict, max_key: str, max_tokens, min_tokens: int, stop: list[str],
              grammar: GrammarSpec | None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_get(body, "temperature", (int, float), 1.0)),
            top_p=float(_get(body, "top_p", (int, float), 1.0)),
            top_k=max(0, _get(body, "top_k", (int,), 0)),
            seed=_get(body, "seed", (int,), None),
            stop=tuple(stop),
            stop_token_ids=tuple(_ints(_get(body, "stop_token_ids", (list,), []))),
            ignore_eos=_get(body, "ignore_eos", (bool,), False),
            min_tokens=min_tokens,
            grammar=grammar,
        )
    except SamplingParamError as e:
        param, message = e.param, str(e)
        if param == "max_tokens":  # the client may have spelled it max_completion_tokens
            param, message = max_key, message.replace("max_tokens", max_key, 1)
        raise ApiError(400, message, param) from None


def _model(body: Any, kind: str) -> str:
    """The checks every endpoint's body starts with; returns its model."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    _known(body, kind)
    model = _get(body, "model", (str,), None)
    if model is None:
        raise ApiError(400, "'model' is required", "model")
    return model


def parse_completion(body: Any, tok: Tokenizer, default_max_tokens: int, vocab_size: int | None = None,
                     max_n: int = 1, max_prompts: int = 64, priority_header: str | None = None) -> GenerateRequest:
    model = _model(body, "completion")
    special = _get(body, "add_special_tokens", (bool,), True)
    prompts, texts = _prompts(body.get("prompt"), tok, vocab_size, max_prompts, special)
    for name in CHAT_ONLY:
        if body.get(name) is not None:
            raise ApiError(400, f"'{name}' is supported on /v1/chat/completions only", name)
    echo = _get(body, "echo", (bool,), False)
    generate = _get(body, "max_tokens", (int,), None) != 0
    if not generate and not echo:
        raise ApiError(400, "'max_tokens' 0 is taken with echo only (the prompt scored, nothing generated)",
                       "max_tokens")
    # The workers always sample a first token (as vLLM's do for max_tokens 0); it is not returned.
    params, opts = _common(body if generate else {**body, "max_tokens": 1}, default_max_tokens,
                           priority_header=priority_header)
    lp = _get(body, "logprobs", (int,), None)
    if lp is not None and not 0 <= lp <= 20:
        raise ApiError(400, "'logprobs' must be in [0, 20]", "logprobs")
    plp = _get(body, "prompt_logprobs", (int,), None)
    if plp is not None and not 0 <= plp <= 20:
        raise ApiError(400, "'prompt_logprobs' must be in [0, 20]", "prompt_logprobs")
    # What the prefill scores: the echoed prompt's logprobs, vLLM's prompt_logprobs, or both.
    scored = [k for k in (plp, lp if echo else None) if k is not None]
    params = replace(params, logprobs=lp, prompt_logprobs=max(scored) if scored else None)
    return GenerateRequest("completion", model, prompts[0], params, logprobs=lp, n=_n(body, max_n), prompts=prompts,
                           prompt_texts=texts, echo=echo, generate=generate, prompt_logprobs=plp, **opts)


def _prompts(prompt, tok: Tokenizer, vocab_size: int | None, max_prompts: int,
             add_special_tokens: bool = True) -> tuple[list, list]:
    """(token ids, text as given or None) of each prompt: a string, an array of token ids,
    or an array of either (a batch). add_special_tokens: for a string (the tokenizer's BOS);
    token ids are taken as they are."""
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompt = [prompt]
    if not (isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                     or all(_token_ids(p) for p in prompt))):
        raise ApiError(400, "'prompt' must be a string, an array of token ids, or a non-empty array of strings or "
                            "of token id arrays", "prompt")
    if len(prompt) > max_prompts:
        raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; this server takes at most {max_prompts} in one "
                            f"request", "prompt")
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            ids.append(tok.encode(p, add_special_tokens=add_special_tokens))
            texts.append(p)
            continue
        p = _ints(p)
        if vocab_size is not None and not all(0 <= t < vocab_size for t in p):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
        ids.append(p)
        texts.append(None)
    return ids, texts


def _token_ids(p) -> bool:
    return isinstance(p, list) and bool(p) and all(_is_int(_integral(t)) for t in p)


def parse_chat(body: Any, tok: Tokenizer, default_max_tokens: int, vocab_size: int | None = None,
               max_n: int = 1, priority_header: str | None = None) -> GenerateRequest:
    model = _model(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", "messages")
    tools = None  # parse_tools' answer when none of its fields came
    if body.get("tools") is not None or body.get("tool_choice") is not None \
            or body.get("parallel_tool_calls") is not None:
        try:
            tools = parse_tools(body, tok)
        except ToolError as e:
            raise ApiError(400, str(e), e.param, code=e.code) from None
    norm = chat_messages(messages)
    try:
        # vLLM's add_special_tokens: off by default, since the template writes its own BOS.
        ids = tok.encode(tok.apply_chat_template(norm, tools=tools.tools if tools else None),
                         add_special_tokens=_get(body, "add_special_tokens", (bool,), False))
    except TokenizerError as e:
        raise ApiError(400, str(e), "messages") from None
    params, opts = _common(body, default_max_tokens, "max_completion_tokens", tools.grammar() if tools else None,
                           priority_header)
    lp = None
    top = _get(body, "top_logprobs", (int,), 0)
    if not 0 <= top <= 20:  # checked even without logprobs: the request asked for something
        raise ApiError(400, "'top_logprobs' must be in [0, 20]", "top_logprobs")
    if _get(body, "logprobs", (bool,), False):
        lp = top
        params = _with_logprobs(params, lp)
    return GenerateRequest("chat", model, ids, params, logprobs=lp, n=_n(body, max_n), tools=tools, **opts)


def chat_messages(messages: list) -> list[dict]:
    """Each message as the chat template reads it (_message); a bad one is a 400."""
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m) -> dict:
    """One chat message as the template reads it: role, content text (null is empty), and
    an assistant's tool_calls or a tool result's tool_call_id. The fields are checked on
    every role, as the OpenAPI document describes one message shape for all."""
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
        raise ApiError(400, f"messages[{i}] needs a role of system, user, assistant or tool", "messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if content is None:  # an assistant turn that only calls tools
        content = ""
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string", "messages")
    role = "system" if m["role"] == "developer" else m["role"]
    out = {"role": role, "content": content}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(_tool_call_ok(c) for c in calls):
            raise ApiError(400, f"messages[{i}].tool_calls must be an array of "
                                '{"id", "type": "function", "function": {"name", "arguments"}}', "messages")
        if role == "assistant":
            out["tool_calls"] = [{"id": c.get("id", ""), "type": "function", "function": {
                "name": c["function"]["name"], "arguments": c["function"].get("arguments", "")}} for c in calls]
    if not isinstance(m.get("tool_call_id", ""), str):
        raise ApiError(400, f"messages[{i}].tool_call_id must be a string", "messages")
    if role == "tool":
        out["tool_call_id"] = m.get("tool_call_id", "")
    return out


def _tool_call_ok(c) -> bool:
    if not isinstance(c, dict) or not isinstance(c.get("id", ""), str) or c.get("type", "function") != "function":
        return False
    f = c.get("function")
    return isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments", ""), str)


def _with_logprobs(p: SamplingParams, n: int) -> SamplingParams:
    return replace(p, logprobs=n)


# ---- responses -------------------------------------------------------------------------
def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """cached: prompt tokens whose KV was reused (prefix cache, other workers, the KV store)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chunk(req: GenerateRequest, text: str, finish: str | None, first: bool = False,
          logprobs: Any = None, index: int = 0) -> dict[str, Any]:
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or first:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": req.response_id, "object": obj, "created": req.created, "model": req.model, "choices": [choice]}


def delta_chunk(req: GenerateRequest, d: Delta, first: bool = False, index: int = 0) -> dict[str, Any]:
    """A chat chunk for one piece of an answer that may hold tool calls: content text, a
    call's start (its id, type and name) or a piece of its arguments, as OpenAI streams them.
    index: the choice's; d.index is the call's within that choice."""
    if not d.call_id and d.index < 0:
        return chunk(req, d.content, None, first, index=index)
    call: dict[str, Any] = {"index": d.index}
    if d.call_id:
        call.update(id=d.call_id, type="function", function={"name": d.name, "arguments": d.arguments})
    else:
        call["function"] = {"arguments": d.arguments}
    delta: dict[str, Any] = {"role": "assistant", "content": None} if first else {}
    delta["tool_calls"] = [call]
    return {"id": req.response_id, "object": "chat.completion.chunk", "created": req.created, "model": req.model,
            "choices": [{"index": index, "delta": delta, "finish_reason": None, "logprobs": None}]}


def tool_chunks(req: GenerateRequest, calls: ToolCallParser, token_id: int, text: str, finish: str | None,
                first: bool, index: int = 0) -> list[dict[str, Any]]:
    """The chunks of one token event (token_id -1: an end with no token of its own) of the
    choice `index`, whose answer may hold tool calls: the role on the choice's first, the
    parser's deltas, and at the end the finish (tool_calls where the choice called one)."""
    out = [chunk(req, "", None, True, index=index)] if first else []
    out += [delta_chunk(req, d, index=index) for d in calls.feed(token_id, text)]
    if finish:
        out.append(chunk(req, "", tool_finish(finish, calls.calls), index=index))
    return out


class ToolLogprobs:
    """Logprobs of a streamed answer that may hold tool calls. The parser holds a call's
    tokens until it knows what they are, so a token's logprob goes out on the next chunk
    its choice sends: every token's once, in order."""

    def __init__(self, req: GenerateRequest, tok: Tokenizer):
        self.req, self.tok, self.pending = req, tok, []

    def put(self, out: list[dict[str, Any]], logprob) -> list[dict[str, Any]]:
        if self.req.logprobs is None:
            return out
        if logprob is not None:
            self.pending.append(logprob)
        if out and self.pending:
            out[0]["choices"][0]["logprobs"] = logprobs_payload(self.req, self.tok, self.pending)
            self.pending = []
        return out


class ChunkBytes:
    """SSE bytes of the common chunk (text only, no finish, no logprobs) from a prefix
    built once per request: per token, only the text is serialised. Other chunks go
    through chunk() and the general serialiser."""

    def __init__(self, req: GenerateRequest, index: int = 0):
        import orjson

        self._dumps = orjson.dumps
        head = self._dumps({"id": req.response_id, "object": "chat.completion.chunk" if req.kind == "chat"
                            else "text_completion", "created": req.created, "model": req.model})[:-1]
        key = b'"delta":{"content":' if req.kind == "chat" else b'"text":'
        self._prefix = b"data: " + head + b',"choices":[{"index":' + str(index).encode() + b',' + key
        tail = (b'},' if req.kind == "chat" else b',') + b'"finish_reason":null,"logprobs":null}]'
        self._suffix = tail + b'}\n\n'
        # continuous usage: the chunk ends with the counts so far (as usage() writes them)
        n_prompt = self._n_prompt = sum(map(len, req.prompts))
        self._usage = tail + b',"usage":{"prompt_tokens":%d,"completion_tokens":' % n_prompt

    def text(self, text: str) -> bytes:
        return self._prefix + self._dumps(text) + self._suffix

    def texts(self, texts: list[str]) -> bytes:
        """One chunk per text, in one write."""
        prefix, dumps, suffix = self._prefix, self._dumps, self._suffix
        return b"".join([prefix + dumps(t) + suffix for t in texts])

    def counted(self, text: str, n: int, cached: int) -> bytes:
        """text's chunk with usage after n completion tokens (stream_options.continuous_usage_stats)."""
        return (self._prefix + self._dumps(text) + self._usage
                + b'%d,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}}\n\n'
                % (n, self._n_prompt + n, cached))


def usage_chunk(req: GenerateRequest, prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": req.response_id, "object": obj, "created": req.created, "model": req.model, "choices": [],
            "usage": usage(prompt, completion, cached)}


def final(req: GenerateRequest, text: str, finish: str, prompt: int, completion: int,
          logprobs: Any = None, cached: int = 0, tool_calls: list[dict] | None = None) -> dict[str, Any]:
    return final_choices(req, [(text, finish, logprobs, tool_calls)], prompt, completion, cached)


def final_choices(req: GenerateRequest, choices: list[tuple], prompt: int, completion: int,
                  cached: int = 0) -> dict[str, Any]:
    """choices: (text, finish reason, logprobs payload[, tool calls]) by index; completion:
    their tokens, all."""
    if req.kind == "chat":
        out = []
        for i, (text, finish, lp, *calls) in enumerate(choices):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls and calls[0]:
                message.update(content=text or None, tool_calls=calls[0])
            out.append({"index": i, "message": message, "finish_reason": finish, "logprobs": lp})
        obj = "chat.completion"
    else:
        out = [{"index": i, "text": text, "finish_reason": finish, "logprobs": lp}
               for i, (text, finish, lp, *_) in enumerate(choices)]
        obj = "text_completion"
    return {"id": req.response_id, "object": obj, "created": req.created, "model": req.model,
            "choices": out, "usage": usage(prompt, completion, cached)}


def tool_finish(finish: str | None, calls: list[dict]) -> str | None:
    """OpenAI's finish reason for an answer that ended in tool calls."""
    return "tool_calls" if finish == "stop" and calls else finish


def logprobs_payload(req: GenerateRequest, tok: Tokenizer, lps: list) -> Any:
    """Chat's logprob shape, the `content` list. (Completions' legacy arrays, whose text
    offsets run across a choice's chunks, are completion_logprobs.py's.)"""
    if req.logprobs is None or not lps:
        return None
    text, name = token_text(tok), token_text(tok, req.tokens_as_ids)
    return {"content": [
        {"token": name(lp.token_id), "logprob": lp.logprob, "bytes": list(text(lp.token_id).encode()),
         "top_logprobs": [{"token": name(t), "logprob": v, "bytes": list(text(t).encode())}
                          for t, v in zip(lp.top_ids, lp.top_logprobs)]}
        for lp in lps]}
