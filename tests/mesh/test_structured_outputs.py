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
