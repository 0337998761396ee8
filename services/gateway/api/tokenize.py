"""The tokenizer endpoints, in vLLM's shapes: POST /tokenize, POST /detokenize and GET
/tokenizer_info. Evaluation tools (lm-eval's local-completions) probe them to count
context lengths with the server's own tokenizer. Parsing and answers only, no I/O; the
routes are in http/app.py. As on the completion routes, a field this server does not
read is a 400 naming it.

/tokenize takes a `prompt` (special tokens added unless add_special_tokens is false) or
chat `messages` (rendered by the chat template, which writes its own; add_generation_prompt
as Hugging Face's), and answers {count, max_model_len, tokens, token_strs}.
/detokenize takes `tokens` and answers {prompt}, special tokens written out.
/tokenizer_info answers the tokenizer's configuration (tokenizer_config.json without its
file names and token table), its class, and the chat template.
"""

from __future__ import annotations

from typing import Any

from moemesh.services.gateway.api.openai_api import ApiError, chat_messages
from moemesh.shared.tokenizer.tokenizer import Tokenizer, TokenizerError

TOKENIZE = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                      "return_token_strs"})
DETOKENIZE = frozenset({"model", "tokens"})
# tokenizer_config.json entries that describe files or the whole token table, not the tokenizer's settings
_NOT_INFO = ("added_tokens_decoder", "vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def _body(body: Any, known: frozenset, model_name: str) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    for name in body:
        if name not in known:
            raise ApiError(400, f"'{name}' is not a parameter this server takes", name)
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {model_name!r}", "model",
                       code="model_not_found")
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be a boolean", name)
    return v


def tokenize(body: Any, tok: Tokenizer, model_name: str, max_model_len: int) -> dict[str, Any]:
    body = _body(body, TOKENIZE, model_name)
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "give 'prompt' (a string) or 'messages' (a chat), one of them", "prompt")
    prompt, messages = body.get("prompt"), body.get("messages")
    if "prompt" in body:
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string", "prompt")
        if "add_generation_prompt" in body:
            raise ApiError(400, "'add_generation_prompt' goes with 'messages' only", "add_generation_prompt")
        text, special = prompt, _flag(body, "add_special_tokens", True)
    else:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty array", "messages")
        try:
            text = tok.apply_chat_template(chat_messages(messages), _flag(body, "add_generation_prompt", True))
        except TokenizerError as e:
            raise ApiError(400, str(e), "messages") from None
        special = _flag(body, "add_special_tokens", False)  # the template writes its own
    ids = tok.encode(text, add_special_tokens=special)
    strs = [tok.id_to_token(i) for i in ids] if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: Any, tok: Tokenizer, model_name: str, vocab_size: int) -> dict[str, Any]:
    body = _body(body, DETOKENIZE, model_name)
    ids = body.get("tokens")
    ids = [_integral(t) for t in ids] if isinstance(ids, list) else ids  # 3.0 is the integer 3, as JSON Schema says
    if not (isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab_size for t in ids)):
        raise ApiError(400, f"'tokens' must be an array of token ids in [0, {vocab_size})", "tokens")
    return {"prompt": tok.decode(ids, skip_special_tokens=False)}


def tokenizer_info(tok: Tokenizer) -> dict[str, Any]:
    info = {k: _text(v) for k, v in tok.config.items() if k not in _NOT_INFO and k != "chat_template"}
    info["tokenizer_class"] = info.get("tokenizer_class") or "PreTrainedTokenizerFast"
    if tok.chat_template:
        info["chat_template"] = tok.chat_template
    return info


def _integral(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _text(v):
    """A special token as its text ({"content": ...} as some configs store it)."""
    return v.get("content", v) if isinstance(v, dict) and "content" in v else v
