"""The Responses API (/v1/responses) on the real server with the default model, through the official openai
client: create, retrieve, input items, delete; a conversation continued by previous_response_id (its prompt
from the radix cache); function calls and their outputs; structured output; the typed event stream; background
responses and their cancellation; the refusals."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from server_util import Server

TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                         "additionalProperties": False}}]


@pytest.fixture(scope="module")
def server():
    srv = Server("--max-total-tokens", "8192", "--enable-deterministic-inference")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_create_retrieve_and_continue_a_conversation(oai):
    first = oai.responses.create(model="default", input="What is the capital of France?", temperature=0,
                                 max_output_tokens=24)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    assert first.usage.input_tokens > 0 and 0 < first.usage.output_tokens <= 24
    got = oai.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    items = oai.responses.input_items.list(first.id).data
    assert [i.type for i in items] == ["message"] and items[0].content[0].text == "What is the capital of France?"

    second = oai.responses.create(model="default", input="And of Italy?", previous_response_id=first.id,
                                  temperature=0, max_output_tokens=24)
    # the new prompt holds the first turn, question and answer, and reuses its KV
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2
    assert second.previous_response_id == first.id

    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)


def test_function_calls_and_their_outputs(oai):
    call = oai.responses.create(model="default", input="What is the weather in Oslo?", tools=TOOLS,
                                tool_choice="required", temperature=0)
    assert call.status == "completed" and [o.type for o in call.output] == ["function_call"]
    fc = call.output[0]
    assert fc.name == "get_weather" and json.loads(fc.arguments)["city"] and fc.call_id.startswith("call_")
    answer = oai.responses.create(model="default", previous_response_id=call.id, tools=TOOLS, temperature=0,
                                  max_output_tokens=32, tool_choice="none", input=[
                                      {"type": "function_call_output", "call_id": fc.call_id,
                                       "output": '{"temperature_c": 4}'}])
    assert answer.output[0].type == "message" and answer.output_text
    # the same turn given whole, as a stateless client sends it
    whole = oai.responses.create(model="default", tools=TOOLS, temperature=0, max_output_tokens=32,
                                 tool_choice="none", input=[
                                     {"role": "user", "content": "What is the weather in Oslo?"},
                                     {"type": "function_call", "call_id": fc.call_id, "name": fc.name,
                                      "arguments": fc.arguments},
                                     {"type": "function_call_output", "call_id": fc.call_id,
                                      "output": '{"temperature_c": 4}'}])
    assert whole.output_text == answer.output_text


def test_structured_output(oai):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    out = oai.responses.create(model="default", input="Where is the Eiffel Tower?", temperature=0,
                               text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    jsonschema.validate(json.loads(out.output_text), schema)
    assert out.text.format.type == "json_schema"


def test_the_event_stream(oai):
    events = list(oai.responses.create(model="default", input="Write a haiku about rain.", temperature=0,
                                       max_output_tokens=32, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert len(deltas) > 5 and "".join(deltas) == final.output_text
    plain = oai.responses.create(model="default", input="Write a haiku about rain.", temperature=0,
                                 max_output_tokens=32)
    assert plain.output_text == final.output_text
    calls = [e for e in oai.responses.create(model="default", input="Weather in Rome?", tools=TOOLS,
                                             tool_choice="required", temperature=0, stream=True)]
    done = [e for e in calls if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["city"] and calls[-1].type == "response.completed"


def test_background_and_cancel(oai):
    bg = oai.responses.create(model="default", input="Count from 1 to 500, one number per line.", background=True,
                              max_output_tokens=2000, temperature=0)
    assert bg.status in ("queued", "in_progress")
    time.sleep(0.5)
    cancelled = oai.responses.cancel(bg.id)
    assert cancelled.status == "cancelled" and oai.responses.retrieve(bg.id).status == "cancelled"
    done = oai.responses.create(model="default", input="Say hi.", background=True, max_output_tokens=8)
    for _ in range(200):
        got = oai.responses.retrieve(done.id)
        if got.status not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    assert got.status in ("completed", "incomplete") and got.output_text


@pytest.mark.parametrize("body,status,words", [
    ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "Previous response with id 'resp_nope' not found"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "not supported (function tools only)"),
    ({"input": []}, 400, "input must not be empty"),
    ({"input": "hi", "background": True, "stream": True}, 400, "cannot be streamed"),
    ({"input": [{"type": "function_call", "name": "f"}]}, 400, "needs call_id, arguments"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "stream": True, "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, 400, "$ref"),
])
def test_refusals(server, body, status, words):
    r = httpx.post(server.url + "/v1/responses", json={"model": "default", **body}, timeout=60)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text


def test_only_background_responses_cancel_and_unstored_ones_are_not_kept(server, oai):
    plain = oai.responses.create(model="default", input="hi", max_output_tokens=4)
    r = httpx.post(f"{server.url}/v1/responses/{plain.id}/cancel", timeout=30)
    assert r.status_code == 400 and "background=true" in r.json()["error"]["message"]
    unstored = oai.responses.create(model="default", input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
