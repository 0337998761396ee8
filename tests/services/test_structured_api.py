"""The gateway's side of structured outputs and tool calls, without a mesh: what
response_format, tools and tool_choice become (or the 400 naming them), the template
rendering the tools and tool results, and the parser that turns generated tokens back into
content and tool_calls, one parser per choice when n is above 1."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from opentelemetry import trace

from moemesh.services.gateway.api import openai_api as api
from moemesh.services.gateway.api.tool_calls import MARKERS, ToolCallParser
from moemesh.services.gateway.streaming import choices
from moemesh.services.gateway.streaming.choices import Choices, Handle
from moemesh.shared.protocol.messages import GrammarSpec
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


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("kw, verdict", [
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": ""}}}, "refused"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ""}}}, "refused"),
    ({"tool_choice": NAMED}, "refused"),
    ({"tools": [], "tool_choice": "required"}, "refused"),
    ({"tools": None, "tool_choice": "required"}, "refused"),
    ({"tools": [CLOCK], "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "refused"),
    ({"tools": [CLOCK], "tool_choice": "required", "response_format": {"type": "text"}}, "served"),
    ({"tools": [CLOCK], "tool_choice": NAMED, "response_format": None}, "served"),
    ({"tools": [], "tool_choice": "auto"}, "served"),
    ({"tools": [], "tool_choice": "none", "response_format": {"type": "json_object"}}, "served"),
    ({"tool_choice": None}, "served"),
    # What a JSON schema cannot say, and the document says in words instead.
    ({"tools": [WEATHER], "tool_choice": NAMED}, "unforeseeable"),
    ({"tools": [CLOCK, CLOCK]}, "unforeseeable"),
])
def test_the_openapi_document_allows_the_tool_settings_the_parser_takes(tok, kw, verdict):
    jsonschema = pytest.importorskip("jsonschema")
    from moemesh.services.gateway.api.openapi import openapi_document

    doc = openapi_document("tiny", 1000, 64, 4)
    schema = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}
    allowed = jsonschema.Draft202012Validator(schema).is_valid(body)
    try:
        api.parse_chat(body, tok, 16)
        served, code = True, None
    except api.ApiError as e:
        served, code = False, e.code
    if verdict == "unforeseeable":
        assert allowed and not served and code == "tool_mismatch"
    else:
        assert allowed == served == (verdict == "served"), (allowed, served, code)


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


def test_n_above_1_with_tools_is_served_and_a_forced_call_constrains_every_choice(tok):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, CLOCK], "n": 3}
    r = api.parse_chat({**body, "tool_choice": "required"}, tok, 16, None, 4)
    # one grammar on the request's params: the workers fork it into every child's own state
    assert r.n == 3 and r.tools.choice == "required" and r.params.grammar.kind == "lark"
    assert api.parse_chat(body, tok, 16, None, 4).params.grammar is None
    with pytest.raises(api.ApiError) as e:
        api.parse_chat({**body, "n": 5}, tok, 16, None, 4)
    assert e.value.param == "n"


def _mixed_choices(tok):
    """A request of n = 3 with tools, and what each choice's child generated: text only, one
    call, and text then two calls."""
    b, e, cb, ce, sep = MARKERS
    req = api.parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, CLOCK],
                          "n": 3}, tok, 16, None, 4)
    answers = [_ids(tok, "Sunny today."),
               _ids(tok, b, cb, "get_weather", sep, '{"city": "Oslo"}', ce, e),
               _ids(tok, "Checking.", b, cb, "get_weather", sep, '{"city": "Rome"}', ce, cb, "get_time", sep, "{}",
                    ce, e)]
    closed = []
    handles = [Handle(f"r-{i}", "decode-t", lambda rid, why: closed.append(rid)) for i in range(3)]
    for h, ids in zip(handles, answers):
        h.ids, h.finish = list(ids), "stop"
    return req, Choices(handles), closed


def _gateway_state(tok):
    class Metric:
        def observe(self, v): pass

        def inc(self, v=1): pass

    return SimpleNamespace(tok=tok, cfg=SimpleNamespace(inactivity_timeout_s=30.0), tracer=trace.get_tracer("test"),
                           m={"ttft": Metric(), "tokens": Metric()})


def test_each_choice_streams_its_own_text_or_calls(tok):
    req, group, closed = _mixed_choices(tok)
    statuses = []

    async def go():
        return b"".join([part async for part in choices.sse(_gateway_state(tok), req, group, trace.INVALID_SPAN, 0.0,
                                                            statuses.append)])

    events = asyncio.run(go()).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and statuses == [200] and sorted(closed) == ["r-0", "r-1", "r-2"]
    content, calls, finish, roles = {}, {}, {}, set()
    for ev in events[:-2]:
        ch = json.loads(ev.removeprefix("data: "))["choices"][0]
        i, delta = ch["index"], ch["delta"]
        if delta.get("role"):
            roles.add(i)
        content[i] = content.get(i, "") + (delta.get("content") or "")
        for tc in delta.get("tool_calls", []):
            if "id" in tc:
                calls.setdefault(i, []).append({"id": tc["id"], "index": tc["index"], "name": tc["function"]["name"],
                                                "arguments": tc["function"]["arguments"]})
            else:
                assert tc["index"] == calls[i][-1]["index"]  # a piece of the call this choice started last
                calls[i][-1]["arguments"] += tc["function"]["arguments"]
        if ch["finish_reason"]:
            finish[i] = ch["finish_reason"]
    assert roles == {0, 1, 2} and content == {0: "Sunny today.", 1: "", 2: "Checking."}
    assert finish == {0: "stop", 1: "tool_calls", 2: "tool_calls"}
    assert 0 not in calls
    assert [(c["index"], c["name"], c["arguments"]) for c in calls[1]] == [(0, "get_weather", '{"city": "Oslo"}')]
    assert [(c["index"], c["name"], c["arguments"]) for c in calls[2]] == \
           [(0, "get_weather", '{"city": "Rome"}'), (1, "get_time", "{}")]
    ids = [c["id"] for cs in calls.values() for c in cs]
    assert len(set(ids)) == 3 and all(i.startswith("call_") for i in ids)


def test_each_choice_collects_its_own_message(tok):
    req, group, _ = _mixed_choices(tok)
    statuses = []

    async def receive():  # a client that stays
        await asyncio.Event().wait()

    async def go():
        return await choices.collect(SimpleNamespace(receive=receive), _gateway_state(tok), req, group,
                                     trace.INVALID_SPAN, 0.0, statuses.append, {})

    r = json.loads(asyncio.run(go()).body)
    assert statuses == [200] and [c["index"] for c in r["choices"]] == [0, 1, 2]
    msgs = [c["message"] for c in r["choices"]]
    assert [c["finish_reason"] for c in r["choices"]] == ["stop", "tool_calls", "tool_calls"]
    assert msgs[0] == {"role": "assistant", "content": "Sunny today."}
    assert msgs[1]["content"] is None and msgs[2]["content"] == "Checking."
    assert [[(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]] for m in msgs[1:]] == \
           [[("get_weather", '{"city": "Oslo"}')], [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]]
    ids = [c["id"] for m in msgs[1:] for c in m["tool_calls"]]
    assert len(set(ids)) == 3
    assert r["usage"]["completion_tokens"] == sum(len(h.streamed) for h in group.handles)
