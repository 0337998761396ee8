"""The gateway's side of structured outputs and tool calls, without a mesh: what
response_format, tools and tool_choice become (or the 400 naming them), the template
rendering the tools and tool results, and the parser that turns generated tokens back into
content and tool_calls."""

from __future__ import annotations

import json

import pytest

from moemesh.services.gateway import openai_api as api
from moemesh.services.gateway.tool_calls import MARKERS, ToolCallParser
from moemesh.shared.protocol.sampling import GrammarSpec
from moemesh.shared.tokenizer.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


def _chat(tok, **kw):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}
    return api.parse_chat(body, tok, 16)


def _error(tok, **kw) -> api.ApiError:
    with pytest.raises(api.ApiError) as e:
        _chat(tok, **kw)
    assert e.value.status == 400
    return e.value


def test_response_format_becomes_the_grammar(tok):
    assert _chat(tok).params.grammar is None
    assert _chat(tok, response_format={"type": "text"}).params.grammar is None
    assert _chat(tok, response_format={"type": "json_object"}).params.grammar == GrammarSpec("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = _chat(tok, response_format={"type": "json_schema",
                                    "json_schema": {"name": "a_b-1", "schema": schema, "strict": True}}).params.grammar
    assert g.kind == "json_schema" and json.loads(g.text) == schema
    # completions take it too
    r = api.parse_completion({"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}}, tok, 16)
    assert r.params.grammar == GrammarSpec("json_object")


@pytest.mark.parametrize("fmt, words", [
    ("json", "must be an object"),
    ({"type": "yaml"}, "yaml"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "objectx"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema"),
])
def test_a_bad_response_format_is_a_400_naming_it(tok, fmt, words):
    e = _error(tok, response_format=fmt)
    assert e.param == "response_format" and words in e.message


def test_tools_render_through_the_template_and_tool_results_too(tok):
    plain = _chat(tok)
    r = _chat(tok, tools=[WEATHER])
    text = tok.decode(r.prompt_ids, skip_special_tokens=False)
    assert "### get_weather" in text and '"maxLength": 8' in text and len(r.prompt_ids) > len(plain.prompt_ids)
    assert r.tools.choice == "auto" and r.params.grammar is None  # auto: the model chooses, nothing forced
    assert _chat(tok, tools=[WEATHER], tool_choice="none").tools is None
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = api.parse_chat({"model": "tiny", "messages": msgs, "tools": [WEATHER]}, tok, 16)
    text = tok.decode(r.prompt_ids, skip_special_tokens=False)
    assert (f'{MARKERS[0]}{MARKERS[2]}get_weather{MARKERS[4]}{{"city": "Oslo"}}{MARKERS[3]}{MARKERS[1]}' in text)
    assert "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜>" \
           "<｜Assistant｜>" in text


def test_required_and_named_choices_force_a_call_with_a_grammar(tok):
    g = _chat(tok, tools=[WEATHER, CLOCK], tool_choice="required").params.grammar
    assert g.kind == "lark" and '"get_weather"' in g.text and '"get_time"' in g.text and "call+" in g.text
    g = _chat(tok, tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
              parallel_tool_calls=False).params.grammar
    assert '"get_time"' in g.text and '"get_weather"' not in g.text and "call+" not in g.text


@pytest.mark.parametrize("kw, param", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_settings_are_a_400_naming_them(tok, kw, param):
    assert _error(tok, **kw).param == param


def test_tools_on_completions_are_refused(tok):
    with pytest.raises(api.ApiError) as e:
        api.parse_completion({"model": "tiny", "prompt": "x", "tools": [WEATHER]}, tok, 16)
    assert e.value.param == "tools"


def _ids(tok, *pieces):
    """Token ids of a generated answer: marker strings as their special ids, text encoded."""
    out = []
    for p in pieces:
        out += [tok.token_to_id(p)] if p in MARKERS else tok.encode(p, add_special_tokens=False)
    return out


def _parse(tok, ids):
    r = _chat(tok, tools=[WEATHER])
    p = ToolCallParser(r.tools.markers)
    deltas = [d for t in ids for d in p.feed(t, tok.decode([t]))]
    return p, deltas


def test_the_parser_turns_tokens_into_content_and_calls(tok):
    b, e, cb, ce, sep = MARKERS
    ids = _ids(tok, "Let me check.", b, cb, "get_weather", sep, '{"city": "Oslo"}', ce,
               cb, "get_time", sep, "{}", ce, e)
    p, deltas = _parse(tok, ids)
    assert "".join(d.content for d in deltas) == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls] == \
           [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    starts = [d for d in deltas if d.call_id]
    assert [d.index for d in starts] == [0, 1] and [d.call_id for d in starts] == [c["id"] for c in p.calls]
    # the arguments streamed as deltas add up to the call's
    assert "".join(d.arguments for d in deltas if d.index == 0) == '{"city": "Oslo"}'
    assert api.tool_finish("stop", p.calls) == "tool_calls" and api.tool_finish("length", p.calls) == "length"


def test_the_parser_reads_v3s_fenced_format(tok):
    b, e, cb, ce, sep = MARKERS
    ids = _ids(tok, b, cb, "function", sep, 'get_weather\n```json\n{"city": "Rome"}\n```', ce, e)
    p, _ = _parse(tok, ids)
    assert p.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_streamed_tool_chunks_have_openais_shape(tok):
    r = _chat(tok, tools=[WEATHER])
    p = ToolCallParser(r.tools.markers)
    b, e, cb, ce, sep = MARKERS
    chunks = [api.delta_chunk(r, d) for t in _ids(tok, b, cb, "get_weather", sep, "{}", ce, e)
              for d in p.feed(t, tok.decode([t]))]
    first = chunks[0]["choices"][0]["delta"]["tool_calls"][0]
    assert first["index"] == 0 and first["type"] == "function" and first["function"]["name"] == "get_weather"
    assert all(set(c["choices"][0]["delta"]["tool_calls"][0]) == {"index", "function"} for c in chunks[1:])
    final = api.final(r, "", "tool_calls", 3, 4, None, 0, p.calls)
    assert final["choices"][0]["message"]["content"] is None
    assert final["choices"][0]["message"]["tool_calls"] == p.calls
