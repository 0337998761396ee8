"""Which request fields the gateway takes, and the ones it takes only to record.

Nothing a client sends is silently ignored: a field this server does not read is a 400
naming it, and a field it cannot honour at the value given is a 400 naming it too (see
openai_api.UNSUPPORTED). The fields that describe the caller rather than the answer
(`user`, `safety_identifier`, `metadata`) are honoured by recording them on the request's
trace span; `store`, `service_tier` and `modalities` are honoured at the values that
mean what this server does (nothing stored, one tier, text). Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

# Read by openai_api for both endpoints (its vLLM-style extensions included).
COMMON = frozenset({"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed",
                    "stop", "stop_token_ids", "ignore_eos", "min_tokens", "n", "response_format", "logprobs",
                    "user", "tools", "tool_choice", "parallel_tool_calls", "return_tokens_as_token_ids",
                    "add_special_tokens", "priority"})
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "metadata", "store", "service_tier",
                 "modalities", "safety_identifier"}
COMPLETION = COMMON | {"prompt", "echo", "prompt_logprobs"}
# Taken at one value only (null, or the value named): each is refused by name otherwise.
ONLY_AT = {
    "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "suffix": None,
    "functions": None, "function_call": None, "logit_bias": None, "audio": None, "prediction": None,
    "reasoning_effort": None, "verbosity": None, "web_search_options": None, "moderation": None,
    "prompt_cache_key": None, "prompt_cache_options": None, "prompt_cache_retention": None,
}


class FieldError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_known(body: dict, kind: str) -> None:
    """A field neither endpoint reads is refused, by name."""
    known = CHAT if kind == "chat" else COMPLETION
    for name in body:
        if name not in known and name not in ONLY_AT:
            raise FieldError(f"'{name}' is not a parameter this server takes", name)


def caller_attributes(body: dict) -> dict[str, Any]:
    """The caller's identifiers and metadata as span attributes; refuses what it cannot honour."""
    out: dict[str, Any] = {}
    for name, attr in (("user", "user.id"), ("safety_identifier", "moemesh.safety_identifier")):
        v = body.get(name)
        if v is not None:
            if not isinstance(v, str) or len(v) > 512:
                raise FieldError(f"'{name}' must be a string of at most 512 characters", name)
            out[attr] = v
    meta = body.get("metadata")
    if meta is not None:
        if not (isinstance(meta, dict) and len(meta) <= 16 and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in meta.items())):
            raise FieldError("'metadata' must be an object of at most 16 string values", "metadata")
        out.update({f"moemesh.metadata.{k}": v for k, v in meta.items()})
    if body.get("store") not in (None, False):
        raise FieldError("'store' is not supported by this server: nothing is stored (use false or leave it out)",
                         "store")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise FieldError("'service_tier' must be auto or default: this server has one tier", "service_tier")
    if body.get("modalities") not in (None, ["text"]):
        raise FieldError("'modalities' must be [\"text\"]: this server answers in text only", "modalities")
    return out
