"""Every field of the OpenAI request schema (as the official client types it) is either
honoured or refused by name: nothing a client sends is silently ignored."""

from __future__ import annotations

import pytest
from openai.types import completion_create_params as completion_types
from openai.types.chat import completion_create_params as chat_types

from moemesh.services.gateway.api import openai_api as api
from moemesh.shared.tokenizer.tokenizer import Tokenizer

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
# field -> a value the server honours (and takes at face value)
HONOURED_CHAT = {
    "messages": [{"role": "user", "content": "hi"}], "model": "tiny", "max_completion_tokens": 5, "max_tokens": 5,
    "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["x"], "n": 2, "logprobs": True, "top_logprobs": 2,
    "stream_options": {"include_usage": True}, "response_format": {"type": "json_object"},
    "tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": False,
    "user": "u-1", "safety_identifier": "s-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto",
    "modalities": ["text"], "frequency_penalty": 0, "presence_penalty": 0,
}
# field -> a value it cannot honour, refused with a 400 naming the field
REFUSED_CHAT = {
    "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"5": 10}, "functions": [TOOL["function"]],
    "function_call": "auto", "audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "high", "verbosity": "low",
    "web_search_options": {}, "moderation": {"type": "x"}, "prompt_cache_key": "k", "prompt_cache_options": {},
    "prompt_cache_retention": "24h", "store": True, "service_tier": "flex", "n": 99, "seed": 2 ** 70,
    "metadata": {"k": 5}, "user": 5,
}
HONOURED_COMPLETION = {
    "model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": "x",
    "n": 2, "logprobs": 2, "stream_options": {"include_usage": True}, "user": "u-1", "best_of": 1, "echo": True,
    "suffix": None, "frequency_penalty": 0, "presence_penalty": 0,
}
REFUSED_COMPLETION = {
    "best_of": 3, "echo": "yes", "suffix": "end", "frequency_penalty": 1.0, "presence_penalty": 1.0,
    "logit_bias": {"5": 1}, "logprobs": 50, "n": 99, "max_tokens": 0,
}


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


def _chat(tok, **fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return api.parse_chat(body, tok, 16, tok.vocab_size, max_n=4)


def _completion(tok, **fields):
    return api.parse_completion({"model": "tiny", "prompt": "hi", **fields}, tok, 16, tok.vocab_size, max_n=4)


@pytest.mark.parametrize("kind, types, honoured, refused", [
    ("chat", chat_types.CompletionCreateParamsBase, HONOURED_CHAT, REFUSED_CHAT),
    ("completion", completion_types.CompletionCreateParamsBase, HONOURED_COMPLETION, REFUSED_COMPLETION),
])
def test_every_openai_field_is_honoured_or_refused_by_name(tok, kind, types, honoured, refused):
    parse = _chat if kind == "chat" else _completion
    fields = set(types.__annotations__)
    # A field the client library gained since is neither: classify it here first.
    assert fields <= set(honoured) | set(refused), sorted(fields - set(honoured) - set(refused))
    for name, value in honoured.items():
        if name in ("messages", "prompt", "model"):
            continue
        extra = {"tools": [TOOL]} if name == "tool_choice" else {}
        parse(tok, **{name: value, **extra})  # no error
    for name, value in refused.items():
        with pytest.raises(api.ApiError) as e:
            parse(tok, **{name: value})
        assert e.value.status == 400 and e.value.param == name, (name, e.value.message)


def test_a_field_outside_the_schema_is_refused_by_name(tok):
    for parse, name in ((_chat, "frequency"), (_chat, "prompt"), (_completion, "messages"),
                        (_completion, "metadata"), (_completion, "max_completion_tokens")):
        with pytest.raises(api.ApiError) as e:
            parse(tok, **{name: 1})
        assert e.value.param == name and "not a parameter" in e.value.message


def test_caller_fields_are_recorded_for_the_trace(tok):
    req = _chat(tok, user="u-1", safety_identifier="s-9", metadata={"team": "search"})
    assert req.trace_attrs == {"user.id": "u-1", "moemesh.safety_identifier": "s-9", "moemesh.metadata.team": "search"}


def test_the_evaluation_fields_of_completions(tok):
    """echo, max_tokens 0 (with echo only), vLLM's prompt_logprobs, and batches of prompts."""
    r = _completion(tok, echo=True, logprobs=1, max_tokens=0)
    assert r.echo and not r.generate and r.params.max_tokens == 1  # the workers sample one, not returned
    assert r.params.prompt_logprobs == 1 and r.prompt_logprobs is None  # the echo's scores, not vLLM's field
    r = _completion(tok, echo=True, logprobs=1, prompt_logprobs=3)
    assert r.params.prompt_logprobs == 3 and r.prompt_logprobs == 3 and r.generate
    assert _completion(tok, echo=True).params.prompt_logprobs is None  # text alone: nothing to score
    assert _completion(tok, logprobs=2).params.prompt_logprobs is None
    batch = api.parse_completion({"model": "tiny", "prompt": [[5, 6], [7.0]]}, tok, 16, tok.vocab_size)
    assert batch.prompts == [[5, 6], [7]] and batch.prompt_ids == [5, 6] and batch.prompt_texts == [None, None]
    texts = api.parse_completion({"model": "tiny", "prompt": ["a", "b c"]}, tok, 16, tok.vocab_size)
    assert texts.prompts == [tok.encode("a"), tok.encode("b c")] and texts.prompt_texts == ["a", "b c"]
    for prompt in ([], [[]], [[5], "a"], [[5, True]], [[5, 6], 7], {"a": 1}):
        with pytest.raises(api.ApiError) as e:
            api.parse_completion({"model": "tiny", "prompt": prompt}, tok, 16, tok.vocab_size)
        assert e.value.param == "prompt", prompt
    with pytest.raises(api.ApiError, match="at most 2") as e:
        api.parse_completion({"model": "tiny", "prompt": ["a"] * 3}, tok, 16, tok.vocab_size, max_prompts=2)
    for fields in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 1.5}):
        with pytest.raises(api.ApiError) as e:
            _completion(tok, **fields)
        assert e.value.status == 400 and e.value.param == "prompt_logprobs"


def test_priority_comes_from_the_body_or_the_header_and_the_body_wins(tok):
    """vLLM's `priority` (lower is served earlier, 0 by default), or x-request-priority."""
    for parse in (_chat, _completion):
        assert parse(tok).params.priority == 0
        assert parse(tok, priority=-3).params.priority == -3
        assert parse(tok, priority=2.0).params.priority == 2  # JSON's integer 2
        assert parse(tok, priority=None).params.priority == 0
    assert api.parse_completion({"model": "tiny", "prompt": "hi"}, tok, 16, priority_header=" -7 ").params.priority \
        == -7
    assert api.parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "priority": 4}, tok, 16,
                          priority_header="-7").params.priority == 4
    assert api.parse_completion({"model": "tiny", "prompt": "hi", "priority": None}, tok, 16,
                                priority_header="+9").params.priority == 9


@pytest.mark.parametrize("fields, header, param", [
    ({"priority": "high"}, None, "priority"),
    ({"priority": True}, None, "priority"),
    ({"priority": 1.5}, None, "priority"),
    ({"priority": 1001}, None, "priority"),
    ({"priority": -1001}, None, "priority"),
    ({"priority": 2 ** 70}, None, "priority"),
    ({}, "high", "x-request-priority"),
    ({}, "1.5", "x-request-priority"),
    ({}, "", "x-request-priority"),
    ({}, "5000", "x-request-priority"),
    ({}, "9" * 40, "x-request-priority"),
    ({"priority": 1}, "nope", "x-request-priority"),  # a malformed header is refused even when the field wins
])
def test_a_bad_priority_is_a_400_naming_the_field_or_the_header(tok, fields, header, param):
    for parse in (api.parse_completion, api.parse_chat):
        body = {"model": "tiny", **fields, **({"prompt": "hi"} if parse is api.parse_completion else
                                               {"messages": [{"role": "user", "content": "hi"}]})}
        with pytest.raises(api.ApiError) as e:
            parse(body, tok, 16, priority_header=header)
        assert e.value.status == 400 and e.value.param == param, e.value.message
        assert "[-1000, 1000]" in e.value.message or "must be an integer" in e.value.message
