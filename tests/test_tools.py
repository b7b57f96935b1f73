"""Tool calls and reasoning in each model family's own format (runtime/parsers): every parser on whole replies and
on replies fed a character at a time as a stream grows; then the real server on Qwen2.5-Coder-0.5B, whose chat
template writes Hermes-style `<tool_call>` blocks, and on the default model (no tools in its template)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from plait.runtime.entrypoints.openai_protocol import Tool
from plait.runtime.entrypoints.tool_calls import either_schema
from plait.runtime.model_loader.packaged import fetch
from plait.runtime.parsers import (REASONING_PARSERS, Call, ReasoningStream, ToolCallStream, reasoning_parser,
                                   tool_parser)
from server_util import Server

NAMES = {"get_weather", "add"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _streamed(parser_name: str, text: str) -> tuple[str, list[Call], list[str]]:
    """Content, calls and the content pieces sent, feeding `text` one character at a time."""
    stream = ToolCallStream(tool_parser(parser_name, None), NAMES)
    pieces, calls = [], []
    for k in range(1, len(text) + 1):
        content, new = stream.feed(text[:k], final=k == len(text))
        if content:
            pieces.append(content)
        calls += new
    return "".join(pieces), calls, pieces


CASES = [  # parser, reply, content, calls
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [Call("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "add", '
               '"arguments": "{\\"a\\": 2}"}</tool_call>', "", [Call("add", {"a": 1}), Call("add", {"a": 2})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}', "", [Call("add", {"a": 1})]),  # stopped at </
    ("hermes", 'Use <tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     'Use <tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),  # an undeclared tool is content
    ("hermes", "Paris is sunny. <tool_call is how I call tools.", "Paris is sunny. <tool_call is how I call tools.",
     []),
    ("generic", '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]', "",
     [Call("add", {"a": 1}), Call("add", {"a": 2})]),
    ("generic", '{"answer": 3}', '{"answer": 3}', []),
    ("hermes", '```json\n{\n  "name": "add",\n  "arguments": {"a": 1}\n}\n```', "", [Call("add", {"a": 1})]),
    ("hermes", '```python\nprint({"name": "add"})\n```', '```python\nprint({"name": "add"})\n```', []),
    ("hermes", '```json\n{"a": 1}\n```', '```json\n{"a": 1}\n```', []),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": '
               '{"city": "Oslo"}}', "", [Call("add", {"a": 1}), Call("get_weather", {"city": "Oslo"})]),
    ("llama3", '{"name": "add", "parameters": {"a": 1}}', "", [Call("add", {"a": 1})]),
    ("llama3", "The sum is 3.", "The sum is 3.", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', "Sure.", [Call("add", {"a": 1})]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', "",
     [Call("add", {"a": 1}), Call("get_weather", {"city": "Rome"})]),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_each_format_whole_and_streamed(name, text, content, calls):
    got_content, got_calls = tool_parser(name, None).parse(text, NAMES, final=True)
    assert (got_content, got_calls) == (content, calls)
    streamed, streamed_calls, _ = _streamed(name, text)
    assert streamed_calls == calls
    assert streamed.strip() == content


def test_text_streams_beside_tools_and_only_a_possible_marker_is_held():
    text = "The weather is nice today in Paris.<tool_call>" + '{"name": "add", "arguments": {"a": 1}}</tool_call>'
    stream = ToolCallStream(tool_parser("hermes", None), NAMES)
    sent = []
    for k in range(1, len(text) + 1):
        content, calls = stream.feed(text[:k], final=k == len(text))
        sent.append((k, content, calls))
    first_text = next(k for k, c, _ in sent if c)
    assert first_text == 1  # the first character goes out at once
    # while "<tool_c" could still begin a marker it is held; nothing of the call is ever content
    assert "".join(c for _, c, _ in sent) == "The weather is nice today in Paris."
    call_at = next(k for k, _, calls in sent if calls)
    assert call_at == len(text) - len("</tool_call>") + len("</tool_call>")  # when its block closes


def test_a_fenced_reply_streams_once_it_is_not_json():
    code = '```python\nprint("hello")\n```'
    _, _, pieces = _streamed("hermes", code)
    assert len(pieces) > 10  # held only until "```python\np" shows it is code, then a piece per character
    _, calls, pieces = _streamed("hermes", '```json\n{"name": "add", "arguments": {"a": 1}}\n```')
    assert calls == [Call("add", {"a": 1})] and not pieces


def test_auto_picks_the_format_the_template_writes():
    assert type(tool_parser("auto", "{% for t in tools %}<tool_call>{% endfor %}")).__name__ == "HermesParser"
    assert type(tool_parser("auto", "<|python_tag|>")).__name__ == "Llama3Parser"
    assert type(tool_parser("auto", "[TOOL_CALLS]")).__name__ == "MistralParser"
    assert type(tool_parser("auto", "{{ messages }}")).__name__ == "HermesParser"  # generic: the same reading
    assert reasoning_parser("auto", "{{ '</think>' }}") is REASONING_PARSERS["qwen3"]
    assert reasoning_parser("auto", "{{ messages }}") is None and reasoning_parser("none", "</think>") is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_parser("nope", None)


@pytest.mark.parametrize("name,text,inside,reasoning,content", [
    ("qwen3", "<think>\nStep one.\n</think>\n\nThe answer is 4.", False, "Step one.", "The answer is 4."),
    ("qwen3", "The answer is 4.", False, None, "The answer is 4."),
    ("qwen3", "Still thinking, then</think>Four.", True, "Still thinking, then", "Four."),
    ("deepseek-r1", "Hmm.</think>Four.", False, "Hmm.", "Four."),
    ("qwen3", "<think>cut short by max_tokens", False, "cut short by max_tokens", ""),
])
def test_reasoning_whole_and_streamed(name, text, inside, reasoning, content):
    parser = REASONING_PARSERS[name]
    assert parser.split(text, inside) == (reasoning, content)
    stream, pieces, last = ReasoningStream(parser, inside), [], None
    for k in range(1, len(text) + 1):
        delta, last = stream.feed(text[:k], final=k == len(text))
        pieces.append(delta)
        assert "<" not in delta and ">" not in delta  # no tag text ever streams as reasoning
    assert "".join(pieces).strip() == (reasoning or "") and last == content


def test_either_schema_takes_a_call_or_the_final_object():
    final = {"type": "object", "properties": {"answer": {"$ref": "#/$defs/A"}}, "required": ["answer"],
             "$defs": {"A": {"type": "integer"}}}
    schema = json.loads(either_schema([Tool.model_validate(WEATHER)], json.dumps(final)))
    jsonschema.validate({"answer": 3}, schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    for bad in ({"answer": "x"}, {"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


# ---- the real server ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen():
    srv = Server("--model-path", fetch("qwen2.5-coder-0.5b"), "--max-total-tokens", "8192",
                 "--enable-deterministic-inference")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    srv.stop()


ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def test_qwen_calls_tools_in_its_own_format(qwen):
    out = qwen.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=96)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and "Paris" in json.loads(call.function.arguments)["city"]
    assert not choice.message.content or "<tool_call>" not in choice.message.content
    # the result goes back and the model answers from it, in text
    follow = qwen.chat.completions.create(model="default", temperature=0, max_tokens=64, tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 31, "sky": "clear"}'}])
    answer = follow.choices[0]
    assert answer.finish_reason == "stop" and "31" in answer.message.content


def test_qwen_streams_the_same_call_and_text_as_it_comes(qwen):
    whole = qwen.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], temperature=0,
                                         max_tokens=96).choices[0].message
    calls: dict[int, dict] = {}
    finish = None
    for chunk in qwen.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], temperature=0,
                                              max_tokens=96, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        assert not choice.delta.content or "<tool_call>" not in choice.delta.content
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]
    # a question that needs no tool streams its text chunk by chunk, tools or not
    question = [{"role": "user", "content": "Write a short poem about the sea."}]
    chunks = [c.choices[0].delta.content for c in qwen.chat.completions.create(
        model="default", messages=question, tools=[WEATHER], temperature=0, max_tokens=40, stream=True)
        if c.choices and c.choices[0].delta.content]
    plain = qwen.chat.completions.create(model="default", messages=question, temperature=0, max_tokens=40,
                                         tools=[WEATHER]).choices[0].message.content
    assert len(chunks) >= 10 and "".join(chunks) == plain


def test_qwen_calls_tools_through_ollamas_api(qwen):
    """The same call through Ollama's API (the official client): arguments as an object, streamed the same,
    and the result sent back answered in text."""
    import ollama

    client = ollama.Client(host=str(qwen.base_url).rstrip("/").removesuffix("/v1"))
    opts = {"temperature": 0, "num_predict": 96}
    reply = client.chat(model="default", messages=ASK, tools=[WEATHER], options=opts)
    call = reply.message.tool_calls[0]
    assert call.function.name == "get_weather" and "Paris" in call.function.arguments["city"]
    assert not reply.message.content or "<tool_call>" not in reply.message.content
    streamed = [c for part in client.chat(model="default", messages=ASK, tools=[WEATHER], options=opts, stream=True)
                for c in part.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [(call.function.name, call.function.arguments)]
    follow = client.chat(model="default", tools=[WEATHER], options={"temperature": 0, "num_predict": 64}, messages=[
        *ASK, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_name": "get_weather", "content": '{"temperature_c": 31, "sky": "clear"}'}])
    assert not follow.message.tool_calls and "31" in follow.message.content


def test_tools_beside_a_response_format(qwen):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "summary": {"type": "string"}},
              "required": ["city", "summary"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": schema}}
    asks = {"call": ASK, "answer": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 31, "sky": "clear"}'},
        {"role": "user", "content": "Thanks. Now give me the report on Paris from that result."}]}
    seen = set()
    for messages in asks.values():
        out = qwen.chat.completions.create(model="default", messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=96, response_format=fmt).choices[0]
        if out.message.tool_calls:  # a call under the grammar: a valid call, never content
            assert out.finish_reason == "tool_calls" and out.message.content is None
            assert json.loads(out.message.tool_calls[0].function.arguments)["city"]
            seen.add("call")
        else:
            jsonschema.validate(json.loads(out.message.content), schema)
            seen.add("answer")
    assert seen == {"call", "answer"}  # the grammar allowed each where the model wanted it


@pytest.fixture(scope="module")
def thinker():
    """The default model with deepseek-r1's reading: a reply is reasoning up to </think> (a regex makes the model
    write one, so the split is known)."""
    srv = Server("--reasoning-parser", "deepseek-r1", "--enable-deterministic-inference")
    yield srv
    srv.stop()


THINK = {"regex": "[a-z]{2,6}( [a-z]{2,6}){2,4}</think>The answer is 4\\."}


def test_reasoning_comes_apart_whole_and_streamed(thinker):
    oai = openai.OpenAI(base_url=thinker.url + "/v1", api_key="none", max_retries=0)
    ask = [{"role": "user", "content": "What is 2 + 2?"}]
    whole = oai.chat.completions.create(model="default", messages=ask, temperature=0, max_tokens=40,
                                        extra_body=THINK).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert whole.content == "The answer is 4." and reasoning and "think" not in reasoning
    pieces = {"reasoning_content": [], "content": []}
    for chunk in oai.chat.completions.create(model="default", messages=ask, temperature=0, max_tokens=40,
                                             stream=True, extra_body=THINK):
        delta = chunk.choices[0].delta if chunk.choices else None
        for key in pieces:
            if delta is not None and (delta.model_extra or {}).get(key) or getattr(delta, key, None):
                pieces[key].append((delta.model_extra or {}).get(key) or getattr(delta, key))
    assert "".join(pieces["reasoning_content"]).strip() == reasoning and len(pieces["reasoning_content"]) > 1
    assert "".join(pieces["content"]) == "The answer is 4."
    # the Responses API returns it as a reasoning item before the message
    out = oai.responses.create(model="default", input="What is 2 + 2?", temperature=0, max_output_tokens=40,
                               extra_body=THINK)
    assert [o.type for o in out.output] == ["reasoning", "message"] and out.output_text == "The answer is 4."
    assert out.output[0].content[0].text == reasoning


def test_structured_output_applies_after_the_reasoning():
    """The schema binds only after </think>: the reasoning is free text (braces and all), the answer valid JSON."""
    from plait.runtime.constrained.llguidance_backend import LLGuidanceBackend
    from plait.runtime.entrypoints.lark import after_reasoning, json_body
    from plait.runtime.model_loader import load_tokenizer
    from plait.runtime.server_args import default_model_path

    tok = load_tokenizer(default_model_path())
    backend = LLGuidanceBackend(tok, len(tok), [tok.eos_token_id])
    schema = json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]})

    def accepts(grammar: str, text: str) -> bool:
        """`text` whole (then the end of the reply) under the grammar."""
        matcher = backend.compile("ebnf", grammar).matcher()
        ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
        return all(matcher.accept_token(t) for t in ids)

    inside = after_reasoning(json_body(schema, False), "<think>", "</think>", True, lambda t: None)
    assert accepts(inside, 'Two and two: {x} is 4.</think>\n{"answer": 4}')
    assert not accepts(inside, 'Two and two.</think>\n{"answer": "4"}')
    assert not accepts(inside, '{"answer": 4}')  # the block must close first
    assert not accepts(inside, 'Done.</think>{"answer": 4} and more')
    optional = after_reasoning(json_body(schema, False), "<think>", "</think>", False, lambda t: None)
    assert accepts(optional, '{"answer": 4}') and accepts(optional, '<think>Hmm.</think>{"answer": 4}')


def test_a_constrained_reply_reasons_first_through_the_server(thinker):
    oai = openai.OpenAI(base_url=thinker.url + "/v1", api_key="none", max_retries=0)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    out = oai.chat.completions.create(model="default", temperature=0, max_tokens=24, messages=[
        {"role": "user", "content": "What is 2 + 2? Think first."}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).choices[0].message
    # this model never closes its block itself, and the schema waits for it: all of it is reasoning, in words
    assert out.model_extra["reasoning_content"][:1].isalpha() and out.content == ""
