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
    s += "Q: Name a color.\nA: " + pl.gen_string("color", max_tokens=12) + "\n"
    s += "Q: Say hi.\nA: " + pl.gen("hi", max_tokens=6, min_tokens=6, ignore_eos=False)


def test_int_float_regex_and_min_tokens(backend):
    s = typed.run(backend=backend)
    # SGLang's semantics: dtype constrains the text (REGEX_INT, REGEX_FLOAT); the value stays a string
    assert re.fullmatch(r"[-+]?[0-9]+", s["legs"]) and re.fullmatch(r"[-+]?[0-9]*\.?[0-9]+", s["pi"])
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", s["date"])
    assert re.fullmatch(r'"[\w\d\s]*"?', s["color"])  # REGEX_STR (cut short only at max_tokens)
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
        s += pl.assistant(pl.select("yn", ["Yes", "No"]))

    s = answer.run(backend=oai)
    assert "Paris" in s["answer"] and s["yn"] in ("Yes", "No")

    @pl.function
    def unsupported(s):
        s += pl.user("hi")
        s += pl.assistant("Sure, " + pl.gen("x", max_tokens=4))

    with pytest.raises(ValueError, match="after text inside an assistant turn"):
        unsupported.run(backend=oai)


# ---- the rest of SGLang's program surface ----------------------------------------------------
@pl.function
def scoped(s, q):
    with s.system():
        s += "You are a concise assistant."
    with s.user():
        s += q
    with s.assistant():
        s += pl.gen("a", max_tokens=8, temperature=0)
    with s.var_scope("card"):
        s += "Name: " + pl.gen("name", max_tokens=6, stop="\n", temperature=0) + "\n"
    s["extra"] = 42
    return "done"


@pl.function
def called(s, q):
    s.system("You are a concise assistant.")  # a role method given its content appends it at once
    s += pl.user(q)
    s += pl.assistant(pl.gen("a", max_tokens=8, temperature=0))


def test_role_scopes_var_scope_and_item_assignment(backend):
    s = scoped.run(q="Say hi.", backend=backend)
    assert [m["role"] for m in s.messages()] == ["system", "user", "assistant"]
    assert s.messages()[2]["content"] == s["a"]
    assert s["card"] == "Name: " + s["name"] + "\n" and s.text().endswith(s["card"])
    assert s["extra"] == 42 and "extra" in s and s.ret_value == "done" and s.error() is None
    assert repr(s).startswith("ProgramState(")
    t = called.run(q="Say hi.", backend=backend)
    assert t.text() == s.text()[: len(t.text())] and t["a"] == s["a"]  # same turns, same template


@pl.function
def forked(s):
    s += "Count: "
    f = s.fork(3)
    f += lambda i: f"{i}, "  # a callable gets each branch's index
    f[1] += "and "  # indexed append (assigns the branch back to the group)
    f += ["a", "b", "c"]  # one item per branch
    f += pl.gen("g", max_tokens=2, temperature=0)
    f.join()
    with s.copy() as c:
        c += " then" + pl.gen("c", max_tokens=2, temperature=0)
    return [b.text() for b in f]


def test_fork_group_operators_and_copy(backend):
    s = forked.run(backend=backend)
    texts = s.ret_value
    assert [t[: len(t) - len(g)] for t, g in zip(texts, s["g"])] == ["Count: 0, a", "Count: 1, and b", "Count: 2, c"]
    assert len(s["c"]) == 1 and s.text() == "Count: "  # join gathers variables; the parent's text stays
    with pytest.raises(ValueError, match="cannot be replaced"):
        grp = pl.ProgramStateGroup(None, [1, 2])
        grp[0] = 3
    with pytest.raises(ValueError, match="join mode"):
        pl.ForkGroup(None, []).join(mode="zip")


FACTS = ["- Ethan is the father of Liam.\n", "- Noah is the father of Julian.\n", "- Oliver is the father of Carlos.\n"]


@pl.function
def facts(s, joined: bool):
    s += "Read the facts, then answer the question.\nFacts:\n"
    if joined:
        forks = s.fork(len(FACTS))
        forks += lambda i: FACTS[i]
        forks.join(mode="concate_and_append")
    else:
        s += "".join(FACTS)
    s += "Question: Who is the father of Julian?\nAnswer:" + pl.gen("answer", max_tokens=6, stop="\n", temperature=0)


def test_concate_and_append_reuses_the_branches_kv(backend):
    pl.flush_cache(backend)
    s = facts.run(joined=True, backend=backend)
    (info,) = s.join_info  # the runtime built the joined KV from the branches' own
    assert info["reused"] == len(info["input_ids"]) and s.joins == (info["join_id"],)
    # the follow-up call read the fork and every branch from the joined KV: only the question is new
    assert s.get_meta_info("answer")["cached_tokens"] >= info["reused"]
    prompt = s.text()[: len(s.text()) - len(s["answer"])]
    plain = facts.run(joined=False, backend=backend)
    assert plain.text()[: len(plain.text()) - len(plain["answer"])] == prompt  # the same text as the plain join
    pl.global_config.enable_parallel_encoding = False
    try:
        t = facts.run(joined=True, backend=backend)
        assert t.joins == () and t.text()[: len(t.text()) - len(t["answer"])] == prompt
        assert t["answer"] == plain["answer"]  # a text join computes exactly what the plain text does
    finally:
        pl.global_config.enable_parallel_encoding = True
    assert pl.get_server_info(backend)["kv_check"] == "ok"


@pl.function
def thinker(s):
    s += pl.user("Think, then name a color.")
    s += pl.assistant(pl.separate_reasoning(
        pl.gen("a", regex=r"<think>[a-z][a-z ]{0,15}</think>[A-Z][a-z]{1,8}", max_tokens=32, temperature=0),
        model_type="qwen3"))


def test_separate_reasoning_media_errors_trace_and_cache(backend):
    s = thinker.run(backend=backend)
    assert "<think>" not in s["a"] and s["a_reasoning_content"] and "<think>" not in s.text()
    assert s.messages()[-1]["content"] == s["a"]

    @pl.function
    def looks(s):
        s += pl.user(pl.image("cat.png") + "What is this?")

    with pytest.raises(NotImplementedError, match="vision"):
        looks.run(backend=backend)
    assert isinstance(looks.run(backend=backend, stream=True).error(), NotImplementedError)

    traced = scoped.trace(backend=backend, q="Say hi.")
    assert traced.prefix.endswith("Say hi.<|im_end|>\n<|im_start|>assistant\n")
    assert set(traced.variables) == {"a", "name", "card", "extra"} and any(isinstance(n, pl.lang.ir.Gen) for n in traced.nodes)

    @pl.function
    def long_prefix(s, title):
        s += SHARED + "Title: " + title + "\nGenre:" + pl.gen("g", max_tokens=2, temperature=0)

    assert long_prefix.cache(backend) == SHARED + "Title: "  # the text before the first argument
    assert meta_cached(long_prefix.run(title="Dune", backend=backend), "g") >= 32


def test_run_options_batches_usage_and_api_speculation(backend):
    states = few_shot_qa.run_batch([("France",), ("Italy",)], backend=backend)  # positional tuples
    assert "Paris" in states[0]["answer"] and "Rome" in states[1]["answer"]
    gen = few_shot_qa.run_batch([{"country": "Spain"}], backend=backend, generator_style=True)
    assert "Madrid" in next(iter(gen))["answer"]
    s = few_shot_qa.run(country="France", backend=backend, return_logprob=True, top_logprobs_num=2)
    meta = s.get_meta_info("answer")
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == meta["output_token_logprobs_length"]

    def character(s):
        s += "Name: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n\nAnother person.\nName:"
        s += pl.gen("name", stop="\n", temperature=0) + "\nBirthday:" + pl.gen("birthday", stop="\n", temperature=0)
        s += "\nJob:" + pl.gen("job", stop="\n", temperature=0) + "\n"

    usage = backend.token_usage
    usage.reset()
    plain = pl.function(character).run(backend=backend, max_new_tokens=12)
    calls_plain = usage.prompt_tokens
    usage.reset()
    spec = pl.function(num_api_spec_tokens=32)(character).run(backend=backend, max_new_tokens=12)
    assert usage.prompt_tokens < calls_plain  # one call generated ahead for the following gens
    assert spec["name"] == plain["name"]  # greedy either way
    assert pl.flush_cache(backend) is True and pl.get_server_info(backend)["cache_tokens"] == 0
