"""Ollama's API on the real server, through the official `ollama` client and as front-ends send it (raw NDJSON):
the model's listing, chat and generate (streamed and whole, the same text), `format` as a schema, tools,
`options`, a conversation continued from `context`, and refusals in Ollama's error shape."""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_util import KEY

GREEDY = {"temperature": 0, "num_predict": 12, "seed": 1}


@pytest.fixture(scope="module")
def ollama_client(server):
    import ollama

    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})


@pytest.fixture(scope="module")
def name(ollama_client) -> str:
    return ollama_client.list().models[0].model


def test_the_model_is_listed_shown_and_loaded(ollama_client, name, http):
    import ollama

    listed = ollama_client.list().models
    assert len(listed) == 1 and name.endswith(":latest") and listed[0].size > 0
    assert listed[0].details.format == "gguf" and listed[0].details.family == "llama"
    shown = ollama_client.show(name)
    assert "{{" in shown.template or "{%" in shown.template  # the chat template
    assert shown.modelinfo["llama.context_length"] > 0 and "completion" in shown.capabilities
    assert ollama_client.ps().models[0].model == name
    assert http.get("/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.show("no-such-model:7b")
    assert e.value.status_code == 404 and "not found" in e.value.error
    loaded = ollama_client.chat(model=name, messages=[])  # how apps load a model before the first message
    assert loaded.done and loaded.done_reason == "load"


def test_chat_streamed_and_whole_agree(ollama_client, name):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    whole = ollama_client.chat(model=name, messages=messages, options=GREEDY, stream=False)
    parts = list(ollama_client.chat(model=name, messages=messages, options=GREEDY, stream=True))
    assert whole.message.role == "assistant" and whole.message.content
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert whole.eval_count == parts[-1].eval_count <= 12 and whole.prompt_eval_count > 5
    assert whole.done_reason in ("stop", "length") and whole.total_duration >= whole.eval_duration > 0
    # through the OpenAI API, the same request gives the same reply
    same = ollama_client.chat(model=name.removesuffix(":latest"), messages=messages, options=GREEDY)
    assert same.message.content == whole.message.content


def test_generate_continues_from_its_context(ollama_client, name):
    first = ollama_client.generate(model=name, prompt="Count: one, two,", options=GREEDY, raw=True)
    assert first.response and first.context and first.done_reason == "length" and first.eval_count == 12
    streamed = "".join(p.response for p in ollama_client.generate(model=name, prompt="Count: one, two,",
                                                                  options=GREEDY, raw=True, stream=True))
    assert streamed == first.response
    more = ollama_client.generate(model=name, prompt=" and", context=first.context, options=GREEDY, raw=True)
    assert more.prompt_eval_count == len(first.context) + 1  # " and" is one token after the earlier context
    templated = ollama_client.generate(model=name, prompt="Say hi.", system="Be brief.", options=GREEDY)
    assert templated.response and templated.prompt_eval_count > 10  # the chat template around it


def test_format_is_enforced(ollama_client, name):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"]}
    opts = {"temperature": 0, "num_predict": 60}
    reply = ollama_client.chat(model=name, messages=[{"role": "user", "content": "A city as JSON."}],
                               format=schema, options=opts)
    jsonschema.validate(json.loads(reply.message.content), schema)
    anything = ollama_client.generate(model=name, prompt="A JSON object:", format="json", options=opts)
    assert isinstance(json.loads(anything.response), dict)


def test_a_call_and_its_result_sent_back_as_history(ollama_client, name):
    """Calls come back as objects (test_tools.py has a model that makes them); sent back as history, with the
    tool's result, they reach the chat template as the OpenAI API's calls do."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "18C and sunny", "tool_name": "get_weather"}]
    answer = ollama_client.chat(model=name, messages=history, tools=[tool], options=GREEDY)
    assert answer.done and answer.prompt_eval_count > 30
    text = ollama_client.chat(model=name, messages=history[:1], options=GREEDY)
    assert answer.prompt_eval_count > text.prompt_eval_count + 10  # the call and its result are in the prompt


def test_front_end_requests_and_refusals(http, server, name):
    # as chat front-ends send it: runtime options and keep_alive along, NDJSON back
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "keep_alive": "5m",
            "options": {"num_ctx": 2048, "num_thread": 2, "num_gpu": 0, "use_mmap": True, "repeat_last_n": 64,
                        "temperature": 0, "num_predict": 8, "stop": ["\n\n"], "top_k": 20, "repeat_penalty": 1.1}}
    r = http.post("/api/chat", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[-1]["done"] and not any(line["done"] for line in lines[:-1])
    # as LangChain's ChatOllama sends it: every option named, most of them null
    nulls = {k: None for k in ("mirostat", "mirostat_eta", "mirostat_tau", "num_ctx", "num_gpu", "num_thread",
                               "repeat_last_n", "repeat_penalty", "tfs_z", "top_k", "top_p", "seed", "stop")}
    r = http.post("/api/chat", json={**body, "stream": False, "keep_alive": None, "think": None, "tools": [],
                                     "options": {**nulls, "temperature": 0, "num_predict": 8}})
    assert r.status_code == 200 and r.json()["done"] and r.json()["eval_count"] <= 8, r.text
    for bad, words in ((dict(body, options={"warmth": 1}), "warmth"),
                       (dict(body, options={"mirostat": 2}), "mirostat"),
                       (dict(body, options={"temperature": "hot"}), "temperature"),
                       (dict(body, messages=[{"role": "user", "content": "x", "images": ["aGk="]}]), "images"),
                       (dict(body, format="yaml"), "format"),
                       (dict(body, model="llama3:8b"), "not found"),
                       ({"model": name, "prompt": "x", "suffix": "y"}, "suffix")):
        route = "/api/generate" if "prompt" in bad else "/api/chat"
        r = http.post(route, json=bad)
        assert 400 <= r.status_code < 500 and words in r.json()["error"], (bad, r.text)
    import httpx

    keyless = httpx.post(f"{server.url}/api/chat", json=body, timeout=10)
    assert keyless.status_code == 401 and "API key" in keyless.json()["error"]
    assert http.get("/health").status_code == 200
