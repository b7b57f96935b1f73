"""Prompt programs on the default model, each run on both backends: `Runtime` (the runtime
processes over ZMQ) and `RuntimeEndpoint` (a real server over HTTP)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from server_util import Server

import plait as pl
from conftest import THREADS


@pytest.fixture(scope="module", params=["runtime", "endpoint"])
def backend(request):
    # batch-invariant kernels: programs are compared with the same prompts sent alone, in any dtype
    if request.param == "runtime":
        rt = pl.Runtime(num_threads=THREADS, max_total_tokens=16384, enable_deterministic_inference=True,
                        log_level="warning")
        yield rt
        rt.shutdown()
    else:
        srv = Server("--max-total-tokens", "16384", "--enable-deterministic-inference")
        ep = pl.RuntimeEndpoint(srv.url)
        yield ep
        ep.shutdown()
        srv.stop()


def meta_cached(state, name: str) -> int:
    return state.get_meta_info(name)["cached_tokens"]


def send_by_hand(backend, prompt: str, params: dict) -> str:
    if isinstance(backend, pl.Runtime):
        return backend.engine.generate(prompt, params)["text"]
    return backend._post({"text": prompt, "sampling_params": params})["text"]


FEW_SHOT = "".join(f"Q: What is the capital of {c}?\nA: {a}\n\n" for c, a in
                   [("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"), ("Japan", "Tokyo")])


@pl.function
def few_shot_qa(s, country):
    s += FEW_SHOT + f"Q: What is the capital of {country}?\nA:"
    s += pl.gen("answer", max_tokens=8, stop="\n", temperature=0)


def test_few_shot_qa_and_same_as_by_hand(backend):
    s = few_shot_qa.run(country="France", backend=backend)
    assert "Paris" in s["answer"]
    prompt = s.text()[: -len(s["answer"])]
    assert send_by_hand(backend, prompt, {"max_new_tokens": 8, "stop": ["\n"], "temperature": 0}) == s["answer"]


@pl.function
def chat(s, q1, q2):
    s += pl.system("You are a concise assistant.")
    s += pl.user(q1)
    s += pl.assistant(pl.gen("a1", max_tokens=24, temperature=0))
    s += pl.user(q2)
    s += pl.assistant(pl.gen("a2", max_tokens=24, temperature=0))


def test_multi_turn_chat_uses_the_models_template(backend):
    s = chat.run(q1="What is the capital of France?", q2="And of Italy?", backend=backend)
    msgs = s.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == s["a1"] and "Paris" in s["a1"]
    # the text is exactly the tokenizer's chat template applied to these messages
    rt_tok = getattr(backend, "tokenizer", None)
    if rt_tok is not None:
        assert s.text() == rt_tok.apply_chat_template(msgs, tokenize=False)


@pl.function
def capital_select(s, method):
    s += pl.user("What is the capital of France?")
    s += pl.assistant("The capital of France is " + pl.select("city", ["Paris", "London", "Berlin", "Madrid"],
                                                              choices_method=method))


@pytest.mark.parametrize("method", [pl.token_length_normalized, pl.greedy_token_selection,
                                    pl.unconditional_likelihood_normalized])
def test_select_scores_choices_in_one_call(backend, method):
    s = capital_select.run(method=method, backend=backend)
    meta = s.get_meta_info("city")
    if method == pl.unconditional_likelihood_normalized:  # scores against each city's prior: any may win
        assert s["city"] in ("Paris", "London", "Berlin", "Madrid")
        assert all(meta["unconditional_token_logprobs"]) and len(meta["scores"]) == 4
    else:
        assert s["city"] == "Paris"
    assert len(meta["normalized_prompt_logprobs"]) == 4 and all(lp < 0 for lp in meta["normalized_prompt_logprobs"])
    assert s.text().endswith(f"The capital of France is {s['city']}<|im_end|>\n")


@pl.function
def typed(s):
    s += "Q: How many legs does a spider have?\nA: " + pl.gen_int("legs", max_tokens=4) + "\n"
    s += "Q: Pi to two decimals?\nA: " + pl.gen("pi", dtype=float, max_tokens=8) + "\n"
    s += "Q: A date in ISO format?\nA: " + pl.gen("date", regex=r"\d{4}-\d{2}-\d{2}", max_tokens=12) + "\n"
    s += "Q: Say hi.\nA: " + pl.gen_string("hi", max_tokens=6, min_tokens=6, ignore_eos=False)


def test_int_float_regex_and_min_tokens(backend):
    s = typed.run(backend=backend)
    assert isinstance(s["legs"], int) and isinstance(s["pi"], float)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", s["date"])
    assert s.get_meta_info("hi")["completion_tokens"] == 6


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pl.function
def json_out(s):
    s += pl.user("Describe a person as JSON with name and age.")
    s += pl.assistant(pl.gen("by_regex", max_tokens=48,
                             regex=r'\{"name": "[A-Za-z ]{1,20}", "age": [1-9][0-9]?\}'))
    s += pl.user("Another one.")
    s += pl.assistant(pl.gen("by_schema", max_tokens=48, json_schema=PERSON, temperature=0.7))


def test_json_via_regex_and_schema(backend):
    s = json_out.run(backend=backend)
    assert set(json.loads(s["by_regex"])) == {"name", "age"}
    jsonschema.validate(json.loads(s["by_schema"]), PERSON)


@pl.function
def expert_answer(s, question):
    s += pl.system("You answer questions by consulting experts.")
    s += pl.user(question)
    s += pl.assistant_begin()
    forks = s.fork(2)
    for f, expert in zip(forks, ["a historian", "a geographer"]):
        f += f"As {expert}: " + pl.gen("view", max_tokens=20, temperature=0)
    forks.join()
    s += "In summary: " + pl.gen("summary", max_tokens=20, temperature=0)
    s += pl.assistant_end()


def test_fork_shares_the_prefix_through_the_cache(backend):
    s = expert_answer.run(question="Why is Paris important?", backend=backend)
    views = s["view"]
    assert isinstance(views, list) and len(views) == 2 and all(views)
    branches = s.get_meta_info("view")["branches"]
    prefix_tokens = branches[0]["prompt_tokens"] - 8  # the branch texts differ only in "As ...: "
    assert all(b["cached_tokens"] >= prefix_tokens for b in branches), branches
    assert s["summary"]


TOOLS = ["calculator", "search engine", "weather service"]


@pl.function
def tool_use(s, question):
    s += pl.user(question + " Which tool should I use: a calculator, a search engine or a weather service?")
    s += pl.assistant("I should use the " + pl.select("tool", TOOLS) + ". Input: " +
                      pl.gen("input", max_tokens=12, stop="\n", temperature=0))


def test_tool_use_with_select(backend):
    s = tool_use.run(question="What is 1234 times 5678?", backend=backend)
    assert s["tool"] in TOOLS and s["input"] is not None


@pl.function
def react(s, question):
    s += ("Answer the question by thinking and acting. Actions: Search[term], Finish[answer].\n"
          f"Question: {question}\n")
    for step in range(2):
        s += f"Thought {step + 1}: " + pl.gen(f"thought{step}", max_tokens=16, stop="\n", temperature=0) + "\n"
        s += f"Action {step + 1}: " + pl.select(f"action{step}", ["Search", "Finish"]) + "["
        s += pl.gen(f"arg{step}", max_tokens=8, stop="]", temperature=0) + "]\n"
        if s[f"action{step}"] == "Finish":
            break
        s += f"Observation {step + 1}: Paris is the capital and largest city of France.\n"


def test_react_agent(backend):
    s = react.run(question="What is the capital of France?", backend=backend)
    assert s["action0"] in ("Search", "Finish") and "Thought 1:" in s.text()


@pl.function
def parallel_decode(s, topic):
    s += f"Three facts about {topic}.\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Fact {i + 1}: " + pl.gen("fact", max_tokens=12, stop="\n", temperature=0.8, seed=i)
    forks.join()


def test_parallel_decoding(backend):
    s = parallel_decode.run(topic="the moon", backend=backend)
    assert len(s["fact"]) == 3 and all(isinstance(f, str) for f in s["fact"])


SHARED = ("You are a librarian. Classify each book title into one genre. Genres: fiction, history, science, "
          "cooking, travel. Examples: 'The Joy of Baking' -> cooking; 'A Brief History of Rome' -> history; "
          "'Lonely Planet Peru' -> travel; 'The Selfish Gene' -> science; 'Pride and Prejudice' -> fiction.\n")


@pl.function
def classify(s, title):
    s += SHARED + f"'{title}' ->" + pl.gen("genre", max_tokens=4, stop="\n", temperature=0)


def test_parallel_encoding_run_batch_caches_the_traced_prefix(backend):
    titles = ["War and Peace", "Cosmos", "Salt Fat Acid Heat", "The Guns of August", "Eat Pray Love", "Dune"]
    states = classify.run_batch([{"title": t} for t in titles], progress_bar=False, backend=backend)
    assert all(st["genre"].strip() for st in states)
    # the constant prefix was computed once before the batch: every program read it from the cache
    prefix_tokens = states[0].get_meta_info("genre")["prompt_tokens"] - 12
    assert all(meta_cached(st, "genre") >= prefix_tokens for st in states)
    # and each equals its program run alone
    alone = classify.run(title=titles[1], backend=backend)
    assert alone["genre"] == states[1]["genre"]


@pl.function
def story(s):
    s += pl.user("Tell me a very short story.")
    s += pl.assistant(pl.gen("story", max_tokens=16, temperature=0, return_logprob=True, top_logprobs_num=2))


def test_streaming_text_and_logprobs(backend):
    s = story.run(stream=True, backend=backend)
    chunks = list(s.text_iter("story"))
    assert len(chunks) > 3 and "".join(chunks) == s["story"]
    meta = s.get_meta_info("story")
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 16
    assert all(len(t) == 2 for t in meta["output_top_logprobs"])
    everything = "".join(story.run(stream=True, backend=backend).text_iter())
    assert everything == s.text()

    async def collect():
        s2 = story.run(stream=True, backend=backend)
        return [c async for c in s2.text_async_iter("story")]

    assert "".join(asyncio.run(collect())) == s["story"]


def test_bind_and_errors(backend):
    bound = few_shot_qa.bind(country="Germany")
    assert "Berlin" in bound.run(backend=backend)["answer"]

    @pl.function
    def bad(s):
        s += "x" + pl.gen("y", regex="(unclosed", max_tokens=4)

    with pytest.raises(ValueError, match="regex"):
        bad.run(backend=backend).text()
    with pytest.raises(ValueError, match="choices"):
        pl.select("x", [])
    with pytest.raises(TypeError, match="unknown"):
        pl.gen("x", max_token=3)


def test_openai_backend_on_the_chat_api(backend):
    """The OpenAI backend against plait's own /v1 (the endpoint fixture's server)."""
    if not isinstance(backend, pl.RuntimeEndpoint):
        pytest.skip("needs the HTTP server")
    oai = pl.OpenAI("default", base_url=backend.base_url + "/v1")

    @pl.function
    def answer(s):
        s += pl.system("You are a helpful assistant.")
        s += pl.user("What is the capital of France?")
        s += pl.assistant(pl.gen("answer", max_tokens=16, temperature=0))
        s += pl.user("Is that city in Europe? Answer yes or no.")
        s += pl.assistant(pl.select("yn", ["yes", "no"]))

    s = answer.run(backend=oai)
    assert "Paris" in s["answer"] and s["yn"] in ("yes", "no")

    @pl.function
    def unsupported(s):
        s += pl.user("hi")
        s += pl.assistant("Sure, " + pl.gen("x", max_tokens=4))

    with pytest.raises(ValueError, match="after text inside an assistant turn"):
        unsupported.run(backend=oai)
