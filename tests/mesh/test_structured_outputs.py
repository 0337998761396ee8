"""Structured outputs and tool calls through a real mesh, with the official openai client:
the prefill worker samples the first token under the grammar and the decode worker goes on
from it (the P/D hand-off), so a reply that validates shows the state crossed over. The
tiny random model never writes JSON, nor a tool call, by itself."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic
import pytest

from moemesh.shared.protocol.forks import fork_seed
from tests.json_check import validate

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                   "size": {"type": "string", "enum": ["small", "large"]}},
    "required": ["name", "ok", "size"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "local"]}},
    "required": ["zone"], "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "Describe the expert as JSON"}]


class Answer(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    ok: bool
    size: Literal["small", "large"]


@pytest.fixture
def client(mesh):
    c = openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def test_json_schema_and_json_object_through_prefill_and_decode(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=120, seed=1, response_format=fmt)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    validate(r.choices[0].message.content, SCHEMA)
    parts = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=120, seed=2,
                                                response_format=fmt, stream=True))
    validate("".join(p.choices[0].delta.content or "" for p in parts), SCHEMA)
    assert parts[-1].choices[0].finish_reason == "stop"
    # greedy, and a prompt whose answer closes in a few dozen tokens: sampled (or after most
    # prompts) a random model's JSON strings run for hundreds
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "The router as JSON"}],
                                       max_tokens=120, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    free = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=60, seed=1)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_the_clients_structured_output_helper_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model="tiny", messages=MSGS, max_tokens=120, seed=4, response_format=Answer)
    a = r.choices[0].message.parsed
    assert isinstance(a, Answer) and len(a.name) <= 6 and a.size in ("small", "large")


def test_an_invalid_schema_is_a_400_naming_response_format(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    assert e.value.body["param"] == "response_format"


def test_a_tool_calling_loop(client):
    """required: the call is guaranteed, its arguments valid; the result goes back as a
    tool message and the next turn answers (tool_choice none: text). One call per turn: with
    parallel calls allowed a random model rarely stops adding more."""
    msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER, CLOCK], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=120, seed=5)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = choice.message.tool_calls
    assert len(calls) == 1 and all(c.type == "function" and c.id for c in calls)
    for c in calls:
        validate(c.function.arguments, (WEATHER if c.function.name == "get_weather" else CLOCK)["function"]["parameters"])
    msgs.append(choice.message.model_dump(exclude_none=True))
    msgs += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER, CLOCK], tool_choice="none",
                                       max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.usage.prompt_tokens > 0


def test_a_named_function_streams_one_call_as_deltas(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, CLOCK], max_tokens=80, seed=6,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False, stream=True)
    chunks = list(stream)
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    starts = [d for d in deltas if d.id]
    assert len(starts) == 1 and starts[0].function.name == "get_time" and {d.index for d in deltas} == {0}
    args = "".join(d.function.arguments or "" for d in deltas)
    validate(args, CLOCK["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _args_ok(name: str, arguments: str) -> None:
    validate(arguments, {"get_weather": WEATHER, "get_time": CLOCK}[name]["function"]["parameters"])


def _call(choice) -> tuple[str, str]:
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    return call.function.name, call.function.arguments


def test_every_choice_of_n_calls_a_tool_when_required_or_named(client):
    """n = 3 children forked from one prefill, each under its own state of the tool-call
    grammar: each choice a valid call of its own, with ids unique across choices."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
              tools=[WEATHER, CLOCK], parallel_tool_calls=False, max_tokens=120, seed=5, n=3)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(**kw, tool_choice=choice)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert [c.finish_reason for c in r.choices] == ["tool_calls"] * 3, r.choices
        for c in r.choices:
            _args_ok(*_call(c))
        assert len({c.message.tool_calls[0].id for c in r.choices}) == 3
    # named: choice i is the call that n = 1 with child i's seed makes (the random model
    # names a different city for each), so each child went through the grammar on its own
    assert {_call(c)[0] for c in r.choices} == {"get_weather"} and len({_call(c) for c in r.choices}) == 3
    singles = [client.chat.completions.create(**{**kw, "n": 1, "seed": fork_seed(5, i)},
                                              tool_choice=choice).choices[0] for i in range(3)]
    assert [_call(c) for c in r.choices] == [_call(c) for c in singles]


def test_required_and_named_calls_stream_per_choice(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, CLOCK], max_tokens=80,
              seed=6, parallel_tool_calls=False, stream=True, n=2, stream_options={"include_usage": True})
    ids = []
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")):
        calls: dict[int, list] = {0: [], 1: []}
        finish, usage = {}, None
        for chunk in client.chat.completions.create(**kw, tool_choice=choice):
            usage = chunk.usage or usage
            for ch in chunk.choices:
                calls[ch.index] += ch.delta.tool_calls or []
                if ch.finish_reason:
                    finish[ch.index] = ch.finish_reason
        assert finish == {0: "tool_calls", 1: "tool_calls"} and usage.completion_tokens > 0
        for deltas in calls.values():
            starts = [d for d in deltas if d.id]
            assert len(starts) == 1 and {d.index for d in deltas} == {0}
            assert name is None or starts[0].function.name == name
            _args_ok(starts[0].function.name, "".join(d.function.arguments or "" for d in deltas))
            ids.append(starts[0].id)
    assert len(set(ids)) == 4


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_calls_carry_every_tokens_logprob_once(client, n):
    """The parser holds a call's tokens until it knows them: their logprobs come on the
    choice's next chunk, so a stream's logprobs are the unstreamed answer's, token by token."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, CLOCK], max_tokens=80,
              seed=6, parallel_tool_calls=False, logprobs=True, top_logprobs=2, n=n,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**kw)
    got: dict[int, list] = {i: [] for i in range(n)}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            got[ch.index] += (ch.logprobs.content or []) if ch.logprobs else []
    for c in whole.choices:
        want = c.logprobs.content
        assert c.finish_reason == "tool_calls" and len(want) > 5
        assert [(e.token, e.logprob) for e in got[c.index]] == [(e.token, e.logprob) for e in want]
        assert all(len(e.top_logprobs) == 2 for e in got[c.index])


def test_tool_choice_auto_with_n_choices(client):
    """auto: the model chooses, per choice. Greedy, every choice is what n = 1 answers (the
    tiny random model answers in text), streamed or not."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
              tools=[WEATHER, CLOCK], max_tokens=12, temperature=0)
    one = client.chat.completions.create(**kw).choices[0]
    assert one.message.tool_calls is None and one.message.content
    want = (one.message.content, one.finish_reason, None)
    r = client.chat.completions.create(**kw, n=2)
    assert [(c.message.content, c.finish_reason, c.message.tool_calls) for c in r.choices] == [want] * 2
    texts, finish = {}, {}
    for chunk in client.chat.completions.create(**kw, n=2, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            assert not ch.delta.tool_calls
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert texts == {0: one.message.content, 1: one.message.content}
    assert finish == {0: one.finish_reason, 1: one.finish_reason}
