"""The real server on a free loopback port: SGLang's native API, the OpenAI API (official client),
streaming, concurrency, disconnects, bad input, metrics, auth. Faults and shutdown: test_server_faults.py;
structured output and tools: test_server_structured.py."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from server_util import KEY, sse_events

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
             "Write a haiku about rain.", "Why is the sky blue?", "Give a synonym for happy.",
             "Who wrote Hamlet?", "What does a CPU do?"]


def greedy(max_new: int = 16) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new}


# ---- native API -----------------------------------------------------------------------------
def test_generate_single_batch_and_input_ids(http):
    one = http.post("/generate", json={"text": "The capital of France is", "sampling_params": greedy(8)}).json()
    assert one["meta_info"]["completion_tokens"] == 8 and len(one["output_ids"]) == 8
    assert one["meta_info"]["finish_reason"] == {"type": "length"}
    assert "Paris" in one["text"]
    batch = http.post("/generate", json={"text": ["The capital of France is", "1, 2, 3, 4,"],
                                         "sampling_params": greedy(8)}).json()
    assert isinstance(batch, list) and batch[0]["output_ids"] == one["output_ids"]
    assert batch[0]["meta_info"]["cached_tokens"] > 0  # the same prompt came before
    ids = http.post("/generate", json={"input_ids": [[504, 3575, 282, 4649, 314], [28, 216]],
                                       "sampling_params": [greedy(4), greedy(2)]}).json()
    assert [r["meta_info"]["completion_tokens"] for r in ids] == [4, 2]
    assert [r["meta_info"]["prompt_tokens"] for r in ids] == [5, 2]


def test_generate_logprobs_and_prefill_only(http):
    prompt = "Paris is the capital of"
    r = http.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 0},
                                     "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                                     "return_text_in_logprobs": True}).json()
    meta = r["meta_info"]
    assert meta["completion_tokens"] == 0 and r["text"] == ""
    lps = meta["input_token_logprobs"]
    assert len(lps) == meta["prompt_tokens"] and lps[0][0] is None  # nothing predicts the first token
    assert all(lp <= 0 for lp, _, _ in lps[1:]) and "".join(t for _, _, t in lps) == prompt
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2
    again = http.post("/generate", json={"text": prompt + " France", "sampling_params": greedy(2)}).json()
    assert again["meta_info"]["cached_tokens"] >= meta["prompt_tokens"] - 1  # the prefill-only call cached it


def test_generate_stream_is_cumulative_and_matches(http):
    body = {"text": "Once upon a time", "sampling_params": greedy(12), "return_logprob": True}
    full = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    snaps = events[:-1]
    assert len(snaps) >= 2
    texts = [s["text"] for s in snaps]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert texts[-1] == full["text"] and snaps[-1]["output_ids"] == full["output_ids"]
    counts = [s["meta_info"]["completion_tokens"] for s in snaps]
    assert counts == sorted(counts) and counts[-1] == 12
    deltas = sum(len(s["meta_info"]["output_token_logprobs"]) for s in snaps)
    assert deltas == 12  # logprobs arrive as deltas
    # SGLang's meta_info keys, which its frontend and clients read (lengths and counts are cumulative)
    assert all(s["meta_info"]["output_token_logprobs_length"] == s["meta_info"]["completion_tokens"] for s in snaps)
    for meta in (full["meta_info"], snaps[-1]["meta_info"]):
        assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
                "weight_version", "num_retractions", "reasoning_tokens", "input_token_logprobs",
                "output_token_logprobs", "output_token_logprobs_length"} <= set(meta)
    assert full["meta_info"]["output_token_logprobs_length"] == 12


def test_info_endpoints(http, server):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["chat_template"]
    assert open(info["model_path"], "rb").read(4) == b"GGUF"  # a path a client can read
    for path in ("/server_info", "/get_server_info"):
        si = http.get(path).json()
        assert si["max_running_requests"] == 16 and "api_key" not in si and si["kv_capacity"] > 0
        # the dtypes and what serves each CPU kernel: C built for the selected level (PLAIT_CPU_ISA or the
        # best the CPU has), or the torch reference
        from plait.kernels import cpu_build, cpu_isa

        level = cpu_isa.selected()
        # --dtype auto: bfloat16 only where the CPU multiplies it natively and the kernels run
        native = cpu_build.c_kernels_possible() and cpu_isa.native_bf16()
        expected_dtype = "bfloat16" if native else "float32"
        assert si["dtype"] == si["kv_cache_dtype"] == expected_dtype and si["enable_deterministic_inference"]
        # --quantized-matmul auto, resolved: int8 activations for the K formats on AVX2, the exact int16 path on the
        # AVX-512 levels
        assert si["quantized_matmul"] == ("exact" if level.startswith(("avx512", "amx")) else "int8-k")
        # the default: the GGUF's own Q4_1 / Q8_0 blocks where the block kernel runs
        assert si["quantization"] == ("auto" if level != "ref" else "none")
        assert si["weight_formats"] == (["q4_1", "q8_0"] if level != "ref" else ["none"])
        assert si["decode_stack"] == ("c" if level != "ref" else "loop")
        assert si["kernels"]["cpu_isa"] == level
        assert set(si["kernels"]) >= {"skinny_linear", "paged_attention", "fused_ops", "token_bitmask", "quant_linear"}
        assert all(v == ("torch" if level == "ref" else f"c/{level}") for k, v in si["kernels"].items() if k != "cpu_isa")
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    assert http.post("/concate_and_append_request", json={"src_rids": ["a"], "dst_rid": "b"}).status_code == 200
    assert http.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200
    assert http.get("/flush_cache").status_code == 200
    assert http.post("/flush_cache").status_code == 200
    assert http.get("/server_info").json()["cache_tokens"] == 0


def test_sglang_frontend_drives_the_server(server):
    sgl = pytest.importorskip("sglang")
    from sglang import RuntimeEndpoint, function, gen, select

    backend = RuntimeEndpoint(server.url, api_key=KEY)

    @function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(gen("answer", max_tokens=16, temperature=0))

    @function
    def sky(s):
        s += "The color of the sky on a clear day is"
        s += select("color", choices=[" blue", " green", " purple"])

    answer = qa.run(question="What is the capital of France?", backend=backend)["answer"]
    assert "Paris" in answer
    state = sky.run(backend=backend)
    assert state["color"] == " blue"
    assert len(state.get_meta_info("color")["normalized_prompt_logprobs"]) == 3
    streamed = qa.run(question="What is the capital of France?", backend=backend, stream=True)
    pieces = list(streamed.text_iter("answer"))
    assert len(pieces) > 1 and "".join(pieces) == answer


# ---- OpenAI API ----------------------------------------------------------------------------

def test_openai_names_the_model_it_serves(oai):
    import openai

    served = oai.models.list().data[0].id
    for name in (served, "default", served.removesuffix(".gguf")):
        assert oai.completions.create(model=name, prompt="1, 2,", max_tokens=2, temperature=0).model == name
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_openai_models_and_completions(oai, http):
    models = oai.models.list().data
    assert len(models) == 1 and models[0].id.endswith(".gguf")
    r = oai.completions.create(model=models[0].id, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, logprobs=2,
                               n=2, stop=["9"])
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text  # greedy
    assert r.choices[0].text.startswith(" 5, 6") and "9" not in r.choices[0].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) and len(lp.top_logprobs[0]) == 2
    n_prompt = http.post("/generate", json={"text": "1, 2, 3, 4,", "sampling_params": {"max_new_tokens": 0}}
                         ).json()["meta_info"]["prompt_tokens"]
    assert r.usage.prompt_tokens == n_prompt  # counted once for the n choices
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)


def test_openai_chat_seed_logprobs_usage(oai):
    msgs = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is 2+2?"}]
    a = oai.chat.completions.create(model="default", messages=msgs, max_completion_tokens=10, temperature=0.8, seed=7,
                                    logprobs=True, top_logprobs=3)
    b = oai.chat.completions.create(model="default", messages=msgs, max_tokens=10, temperature=0.8, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content  # same seed, same text
    assert a.choices[0].message.role == "assistant" and a.choices[0].finish_reason in ("stop", "length")
    content = a.choices[0].logprobs.content
    assert len(content) == a.usage.completion_tokens and len(content[0].top_logprobs) == 3
    assert b.usage.prompt_tokens_details.cached_tokens >= b.usage.prompt_tokens - 1


def test_openai_chat_stream_with_usage(oai):
    msgs = [{"role": "user", "content": "Count from one to five."}]
    full = oai.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0)
    stream = oai.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


# ---- concurrency, disconnects, bad input ------------------------------------------------------
def test_32_concurrent_mixed_requests(server, http, oai):
    """Native, streamed and OpenAI requests at once; each equals the same request sent alone."""
    prompts = [f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]} Answer:" for i in range(32)]
    alone = [http.post("/generate", json={"text": p, "sampling_params": greedy(10)}).json()["text"]
             for p in prompts[:4]]

    async def one(client: httpx.AsyncClient, i: int) -> str:
        p = prompts[i]
        if i % 3 == 0:
            async with client.stream("POST", "/generate", json={"text": p, "sampling_params": greedy(10),
                                                                "stream": True}) as resp:
                events = sse_events([line async for line in resp.aiter_lines()])
            return events[-2]["text"]
        if i % 3 == 1:
            r = await client.post("/v1/completions", json={"prompt": p, "max_tokens": 10, "temperature": 0})
            return r.json()["choices"][0]["text"]
        r = await client.post("/generate", json={"text": p, "sampling_params": greedy(10)})
        return r.json()["text"]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    outs = asyncio.run(main())
    assert outs[:4] == alone
    for i in range(4, 32):  # every request complete: 10 greedy tokens of its own prompt
        assert outs[i] == http.post("/generate", json={"text": prompts[i], "sampling_params": greedy(10)}).json()["text"]


def test_disconnect_mid_stream_frees_kv(server, http):
    before = http.get("/server_info").json()
    with server.client(timeout=30) as c:
        with c.stream("POST", "/generate", json={"text": "Tell me a very long story.", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = http.get("/server_info").json()
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            break
        time.sleep(0.2)
    assert info["num_running"] == 0, "the abandoned request kept running"
    assert info["kv_free"] + info["cache_tokens"] == info["kv_capacity"]  # its KV went back (or to the cache)
    assert info["tokens_generated"] - before["tokens_generated"] < 1000


@pytest.mark.parametrize("path,body,status,words", [
    ("/generate", b'{"text": "hi", "sampling_params": ', 400, "not valid JSON"),
    ("/generate", {"text": "hi", "sampling_params": {"max_tokens": 3}}, 400, "max_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "(a+"}}, 400, "invalid regex"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": '{"not": {"pattern": "^a"}}'}}, 400, "'not' at #/not"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, 400, "schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "needs tools"),
    ("/generate", {"text": "hi", "bogus": 1}, 400, "bogus"),
    ("/generate", {"input_ids": list(range(9000))}, 400, "context length"),
    ("/generate", {"text": 5}, 400, "text"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "context length"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 9}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 404,
     "`gpt-4o` does not exist"),
    ("/generate", {"text": "hi", "kv_joins": "j"}, 400, "kv_joins"),
    ("/join_kv", {"fork_text": "A", "branch_texts": ["b"]}, 400, "branch_texts"),
    ("/join_kv", {"fork_text": "", "branch_texts": ["b", "c"]}, 400, "fork_text"),
])
def test_bad_input_gets_4xx_while_others_stream(server, http, path, body, status, words):
    with server.client() as c, c.stream("POST", "/generate", json={"text": "Count: 1, 2, 3,", "stream": True,
                                                                    "sampling_params": greedy(24)}) as live:
        lines = live.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert words in err["message"] and err["code"] == status and err["type"]
        rest = sse_events([first, *lines])
    assert rest[-1] == "[DONE]" and rest[-2]["meta_info"]["completion_tokens"] == 24


USER = [{"role": "user", "content": "x"}]
POLICY_CASES = [  # one policy on every route: unknown fields named, combinations that cannot hold refused
    ("/v1/chat/completions", {"messages": USER, "bogus_field": 1}, "bogus_field"),
    ("/v1/chat/completions", {"messages": USER, "chat_template": "{{ 1/0 }}"}, "chat_template"),
    ("/v1/completions", {"prompt": "hi", "bogus_field": 1}, "bogus_field"),
    ("/v1/responses", {"input": "hi", "bogus_field": 1}, "bogus_field"),
    ("/abort_request", {"rid": "r", "bogus_field": 1}, "bogus_field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "bogus_field": 1}]}, "bogus_field"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, "content"),
    ("/v1/chat/completions", {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": USER, "min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 20}, "min_tokens"),  # max_tokens defaults to 16
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ("/generate", {"input_ids": [1] * 8100, "sampling_params": {"max_new_tokens": 200}}, "context length"),
]


def test_every_route_refuses_unknown_fields_and_impossible_combinations(http):
    for path, body, words in POLICY_CASES:
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, body if len(str(body)) < 300 else words, r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["code"] == 400, (path, err)
    # fields OpenAI's clients send that change nothing are accepted; a returned message goes back as history
    ok = http.post("/v1/chat/completions", json={
        "messages": [*USER, {"role": "assistant", "content": "y", "refusal": None, "annotations": []}, *USER],
        "max_tokens": 2, "metadata": {"k": "v"}, "store": False, "service_tier": "auto"})
    assert ok.status_code == 200, ok.text
    # an echoed value is cut short: a huge model name gets a small 404
    r = http.post("/v1/chat/completions", json={"model": "m" * 1_000_000, "messages": USER})
    assert r.status_code == 404 and len(r.content) < 1000


def test_auth_body_limit_and_queue_limit(server, http):
    assert httpx.post(server.url + "/generate", json={"text": "hi"}).status_code == 401
    r = httpx.post(server.url + "/generate", json={"text": "hi"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # health stays open
    big = http.post("/generate", content=b"x" * (33 * 2**20), headers={"content-type": "application/json"})
    assert big.status_code == 413

    async def flood():  # 16 running + 48 queued allowed: 80 at once must meet 429s
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as client:
            return await asyncio.gather(*(client.post("/generate", json={"text": f"{i}", "sampling_params": greedy(4)})
                                          for i in range(80)))

    codes = [r.status_code for r in asyncio.run(flood())]
    assert codes.count(429) > 0 and codes.count(200) >= 64 and set(codes) <= {200, 429}
    assert http.post("/generate", json={"text": "hi", "sampling_params": greedy(2)}).status_code == 200


def test_metrics(http):
    http.post("/generate", json={"text": "metrics please", "sampling_params": greedy(4)})
    r = http.post("/generate", json={"text": "A number: ", "sampling_params": {**greedy(4), "regex": "[0-9]{3}"}})
    assert r.json()["meta_info"]["grammar_backend"] == "llguidance"  # auto: a regex goes to llguidance first
    time.sleep(1.2)  # the scheduler's stats arrive about once a second
    text = http.get("/metrics").text
    for name in ("plait:time_to_first_token_seconds_bucket", "plait:inter_token_latency_seconds_bucket",
                 "plait:e2e_request_latency_seconds_bucket", "plait:queue_time_seconds_bucket",
                 "plait:prompt_tokens_total", "plait:generation_tokens_total", "plait:cached_tokens_total",
                 "plait:num_running_reqs", "plait:num_queue_reqs", "plait:token_usage", "plait:cache_hit_rate",
                 "plait:gen_throughput"):
        assert name in text, name
    gen = [line for line in text.splitlines() if line.startswith("plait:generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 4
    grammar = [line for line in text.splitlines() if line.startswith("plait:grammar_requests_total")]
    assert any('backend="llguidance"' in line and float(line.split()[-1]) >= 1 for line in grammar), grammar


def test_plait_bench_and_plait_chat_against_the_server(server):
    import subprocess
    import sys

    bench = subprocess.run([sys.executable, "-m", "plait", "bench", "--base-url", server.url, "--api-key", KEY,
                            "--num-prompts", "8", "--max-concurrency", "4", "--input-len", "32", "--output-len", "8",
                            "--shared-prefix-len", "64", "--ignore-eos"], capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert "8 ok, 0 failed" in bench.stdout and "64 out" in bench.stdout  # ignore_eos: 8 tokens each
    assert re.search(r"\((\d+) cached\)", bench.stdout).group(1) != "0"  # the shared prefix came from the cache
    chat = subprocess.run([sys.executable, "-m", "plait", "chat", "--url", server.url, "--api-key", KEY,
                           "--temperature", "0", "--max-tokens", "12"], input="What is the capital of France?\n/quit\n",
                          capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0 and "Paris" in chat.stdout, chat.stdout + chat.stderr
