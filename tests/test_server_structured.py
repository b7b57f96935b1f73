"""Structured output and tools through the real server: /generate with a schema and a regex, response_format
parsed by the official client, forced, required and auto tool calls, streamed call deltas, refusals before a
stream starts."""

from __future__ import annotations

import json
import re

import pytest


def test_generate_json_schema_and_regex(http):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**9}},
              "required": ["city", "population"]}
    out = http.post("/generate", json={"text": "A city as JSON: ", "sampling_params": {
        "json_schema": json.dumps(schema), "temperature": 0.7, "max_new_tokens": 64}}).json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out  # an output cut at max_new_tokens is no JSON
    data = json.loads(out["text"])
    assert isinstance(data["city"], str) and isinstance(data["population"], int) and data["population"] >= 0
    out = http.post("/generate", json={"text": "Phone: ", "sampling_params": {
        "regex": r"\(\d{3}\) \d{3}-\d{4}", "max_new_tokens": 20}}).json()
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", out["text"])


def test_openai_response_format_parses_into_the_model(oai):
    from pydantic import BaseModel, Field

    class Person(BaseModel):  # bounded strings: a 135M model may otherwise ramble inside one
        name: str = Field(max_length=40)
        age: int
        languages: list[str] = Field(max_length=4)

    done = oai.chat.completions.parse(model="default", response_format=Person, temperature=0, max_tokens=128,
                                      messages=[{"role": "user", "content": "Describe a programmer as JSON."}])
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and done.choices[0].finish_reason == "stop"
    obj = oai.chat.completions.create(model="default", response_format={"type": "json_object"}, max_tokens=96,
                                      messages=[{"role": "user", "content": "Give me a JSON object."}], temperature=0)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"]}}}


def test_openai_forced_tool_calls(oai):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = oai.chat.completions.create(model="default", messages=msgs, tools=[WEATHER, TIME], temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id and args["unit"] in ("celsius", "fahrenheit")
    required = oai.chat.completions.create(model="default", messages=msgs, tools=[WEATHER, TIME],
                                           tool_choice="required", temperature=0.7, seed=3)
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        json.loads(c.function.arguments)
    # the call goes back into the conversation with its result
    follow = oai.chat.completions.create(model="default", max_tokens=24, temperature=0, messages=[
        *msgs, {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}])
    assert follow.choices[0].message.content


def test_required_tool_calls_never_come_back_as_content(oai):
    """A required call yields tool_calls whenever the output holds a complete one: one call unless
    parallel_tool_calls is true (the grammar ends after it), and a list cut by max_tokens gives its complete calls."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for max_tokens in (64, 128):
        one = oai.chat.completions.create(model="default", messages=msgs, tools=[WEATHER, TIME], temperature=0,
                                          tool_choice="required", max_tokens=max_tokens)
        choice = one.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert choice.message.content is None
    many = oai.chat.completions.create(model="default", messages=msgs, tools=[WEATHER, TIME], temperature=0,
                                       tool_choice="required", parallel_tool_calls=True, max_tokens=48)
    choice = many.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and choice.message.content is None
    for c in choice.message.tool_calls:
        assert c.function.name in ("get_weather", "get_time") and isinstance(json.loads(c.function.arguments), dict)


def test_tool_parameters_with_nested_models(oai):
    """Parameters as pydantic writes them for nested models ($defs, $ref) are enforced as a response_format would
    be: the references resolve though the parameters sit under `arguments`."""
    import jsonschema

    params = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "address": {"$ref": "#/$defs/Address"}},
              "required": ["name", "address"], "additionalProperties": False,
              "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                                     "country": {"enum": ["FR", "DE", "IT"]}},
                                    "required": ["city", "country"], "additionalProperties": False}}}
    tool = {"type": "function", "function": {"name": "save_person", "parameters": params}}
    for choice in ("required", {"type": "function", "function": {"name": "save_person"}}):
        out = oai.chat.completions.create(model="default", tools=[tool], tool_choice=choice, temperature=0,
                                          max_tokens=96, messages=[{"role": "user", "content": "Ada lives in Paris."}])
        call = out.choices[0].message.tool_calls[0]
        assert call.function.name == "save_person" and out.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), params)


def test_a_refused_grammar_is_an_http_error_before_the_stream_starts(oai, http):
    """A schema no backend can enforce is refused with a 400, streamed or not: never an error event inside a 200."""
    import openai

    broken = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}, "required": ["a"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": broken}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="Missing"):
            out = oai.chat.completions.create(model="default", tools=[tool], tool_choice="required", stream=stream,
                                              max_tokens=16, messages=[{"role": "user", "content": "hi"}])
            if stream:
                list(out)
    r = http.post("/generate", json={"text": "hi", "stream": True,
                                     "sampling_params": {"json_schema": json.dumps(broken), "max_new_tokens": 8}})
    assert r.status_code == 400 and "Missing" in r.json()["error"]["message"]
    ok = http.post("/generate", json={"text": "hi", "stream": True, "sampling_params": {
        "json_schema": json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}),
        "max_new_tokens": 16}})
    assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")


def test_complete_calls_of_a_cut_list():
    from plait.runtime.entrypoints.tool_calls import parse_constrained

    cut = '[{"name": "a", "arguments": {"x": [1, "]"]}}, {"name": "b", "arguments": {}}, {"name": "c", "argu'
    assert [c.name for c in parse_constrained(cut)] == ["a", "b"]
    assert parse_constrained('[{"name": "a", "argu') == [] and parse_constrained('{"name": "a"') == []
    assert parse_constrained('{"name": "a", "arguments": {"xs": [1, 2') == []  # a cut single call: no list inside
    assert [c.name for c in parse_constrained('{"name": "a", "arguments": {}}')] == ["a"]


def test_openai_streamed_tool_call_deltas_reassemble(oai):
    stream = oai.chat.completions.create(model="default", tools=[WEATHER], tool_choice="required", stream=True,
                                         messages=[{"role": "user", "content": "Weather in Oslo?"}], temperature=0)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            if d.function.name:
                c["name"] += d.function.name
            c["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    assert set(json.loads(calls[0]["arguments"])) == {"city", "unit"}


def test_openai_auto_tool_choice_parses_calls(oai):
    out = oai.chat.completions.create(model="default", tools=[WEATHER], tool_choice="auto", max_tokens=64,
                                      temperature=0, messages=[{"role": "user", "content": "Weather in Rome?"}])
    msg = out.choices[0].message
    # the model may answer or call; either way the response is well formed
    if msg.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
        json.loads(msg.tool_calls[0].function.arguments)
    else:
        assert msg.content is not None


