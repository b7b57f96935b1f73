"""Agent frameworks, unchanged, against the real server on Qwen2.5-Coder-0.5B: openai-agents (its default model
is the Responses API), LangChain with LangGraph (and its OpenAIEmbeddings on the all-MiniLM-L6-v2 served beside),
pydantic-ai and instructor. Each runs a small agent with a tool
it must call and whose result it must use, and a structured output type; the assertions are at the protocol's
level (the call the model made, the tool result the next turn saw, the parsed output), not on the model's prose.

These run in their own venv (`make test-frameworks`): openai-agents pins an older openai client than plait's.
"""

from __future__ import annotations

import asyncio
from typing import Iterable

import pytest
from pydantic import BaseModel
from server_util import Server

ASK = "What is the weather in Paris right now?"


class Person(BaseModel):
    name: str
    age: int


class Report(BaseModel):
    city: str
    summary: str


@pytest.fixture(scope="module")
def url():
    srv = Server("--model-path", "qwen2.5-coder-0.5b", "--max-total-tokens", "16384",
                 "--enable-deterministic-inference", "--embedding-model-path", "all-minilm-l6-v2")
    yield srv.url + "/v1"
    assert srv.stop() == 0


def _weather_log() -> tuple[list[str], callable]:
    seen: list[str] = []

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"It is 21 degrees Celsius and sunny in {city}."

    return seen, get_weather


def test_openai_agents(url):
    from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_client,
                        set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=url, api_key="none"))
    seen, get_weather = _weather_log()
    tool = function_tool(get_weather)

    async def run():
        # the tool's result is the answer (stop_on_first_tool), through the Responses API
        first = await Runner.run(Agent(name="weather", instructions="Use the tools.", tools=[tool], model="default",
                                       tool_use_behavior="stop_on_first_tool",
                                       model_settings=ModelSettings(tool_choice="required", temperature=0)), ASK)
        assert seen == ["Paris"] and first.final_output == "It is 21 degrees Celsius and sunny in Paris."
        # a structured output type, streamed (with the tool too, this 0.5B model calls it again and again)
        streamed = Runner.run_streamed(Agent(name="report", instructions="Report on the weather.", model="default",
                                             output_type=Report,
                                             model_settings=ModelSettings(temperature=0, max_tokens=200)),
                                       ASK + " It is 21 degrees Celsius and sunny there.")
        kinds = [event.type async for event in streamed.stream_events()]
        assert "raw_response_event" in kinds and isinstance(streamed.final_output, Report)
        assert streamed.final_output.city

    asyncio.run(run())


def test_langchain_and_langgraph(url):
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    llm = ChatOpenAI(base_url=url, api_key="none", model="default", temperature=0, max_tokens=200)
    for method in ("function_calling", "json_schema", "json_mode"):
        person = llm.with_structured_output(Person, method=method).invoke(
            "Extract the person as JSON with name and age: John is 31 years old.")
        assert person == Person(name="John", age=31), method
    seen, get_weather = _weather_log()
    out = create_react_agent(llm, [tool(get_weather)]).invoke({"messages": [("user", ASK)]})
    calls = [c for m in out["messages"] for c in getattr(m, "tool_calls", [])]
    assert calls and calls[0]["name"] == "get_weather" and seen == ["Paris"]
    results = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert results and "21 degrees" in results[0].content and out["messages"][-1].type == "ai"
    chunks = list(llm.stream("Write two sentences about the sea."))
    assert len(chunks) > 10


def test_langchain_embeddings(url):
    """LangChain's OpenAIEmbeddings on the server's embedding model (check_embedding_ctx_length off: else it sends
    OpenAI's tiktoken ids); the vectors are the server's own, and a query finds its passage."""
    import httpx
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="all-minilm-l6-v2", base_url=url, api_key="none", check_embedding_ctx_length=False)
    docs = ["It is sunny and 21 degrees in Paris today.", "Knead the dough, then bake the bread for forty minutes.",
            "The train leaves the station at noon."]
    vectors = emb.embed_documents(docs)
    query = emb.embed_query(ASK)
    scores = [sum(a * b for a, b in zip(query, v)) for v in vectors]
    assert scores.index(max(scores)) == 0
    direct = httpx.post(f"{url}/embeddings", json={"input": docs[1]}).json()["data"][0]["embedding"]
    assert max(abs(a - b) for a, b in zip(direct, vectors[1])) < 1e-5


def test_pydantic_ai(url):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("default", provider=OpenAIProvider(base_url=url, api_key="none"))
    settings = {"temperature": 0, "max_tokens": 200}
    assert Agent(model, output_type=Person, model_settings=settings).run_sync(
        "John is 31 years old.").output == Person(name="John", age=31)
    seen, get_weather = _weather_log()
    run = Agent(model, tools=[get_weather], model_settings=settings).run_sync(ASK)
    kinds = [p.part_kind for m in run.all_messages() for p in m.parts]
    assert seen == ["Paris"] and kinds.index("tool-call") < kinds.index("tool-return") < len(kinds) - 1


def test_instructor(url):
    import instructor
    import openai

    msgs = [{"role": "user", "content": "John is 31 years old."}]
    for mode in (instructor.Mode.TOOLS, instructor.Mode.TOOLS_STRICT, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(openai.OpenAI(base_url=url, api_key="none"), mode=mode)
        got = client.chat.completions.create(model="default", response_model=Person, temperature=0, max_tokens=200,
                                             messages=msgs)
        assert got.model_dump() == {"name": "John", "age": 31}, mode
    client = instructor.from_openai(openai.OpenAI(base_url=url, api_key="none"), mode=instructor.Mode.PARALLEL_TOOLS)
    people = list(client.chat.completions.create(model="default", response_model=Iterable[Person], temperature=0,
                                                 max_tokens=200, messages=msgs))
    assert people and people[0].model_dump() == {"name": "John", "age": 31}
    partial = instructor.from_openai(openai.OpenAI(base_url=url, api_key="none"), mode=instructor.Mode.TOOLS)
    last = None
    for last in partial.chat.completions.create_partial(model="default", response_model=Person, temperature=0,
                                                        max_tokens=200, messages=msgs):
        pass
    assert last is not None and last.name == "John" and last.age == 31
