"""A hostile client against the real server: every request that once took the server down or got a
bare 500 now gets a 4xx with an OpenAI-style body naming the problem (or a correct 200), and the
server keeps serving; refused requests leave nothing behind; browser and key handling; the
server's own promises on disconnect and SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
from server_util import Server

KEY = "hostile-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server():
    os.environ["PLAIT_API_KEY"] = KEY  # the key from the environment: not on the command line
    try:
        srv = Server("--max-total-tokens", "8192", "--max-running-requests", "4", "--max-queued-requests", "0",
                     "--shutdown-timeout", "3", "--grammar-compile-timeout", "5")
    finally:
        del os.environ["PLAIT_API_KEY"]
    srv.api_key = KEY
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()


@pytest.fixture(scope="module")
def http(server):
    with server.client(timeout=120) as c:
        yield c


def gen(sp: dict, **extra) -> tuple[str, dict]:
    return "/generate", {"text": "Write dragons:", "sampling_params": {"max_new_tokens": 4, **sp}, **extra}


def chat(**extra) -> tuple[str, dict]:
    return "/v1/chat/completions", {**CHAT, **extra}


def raw(path: str, text: str) -> tuple[str, bytes]:
    return path, text.encode("utf-8", "surrogatepass")


# (path, body, expected status, words the error names)
CASES = [
    (*gen({"top_k": 100000}), 200, None),  # clamped to the vocabulary, as SGLang does
    (*chat(top_k=100000), 200, None),
    (*gen({"stop_token_ids": [999999], "min_new_tokens": 2}), 400, "stop_token_ids"),
    (*chat(stop_token_ids=[999999], min_tokens=2), 400, "stop_token_ids"),
    (*gen({}, return_logprob=True, top_logprobs_num=True), 400, "top_logprobs_num"),
    (*gen({}, return_logprob=True, logprob_start_len=True), 400, "logprob_start_len"),
    (*gen({"max_new_tokens": 2**80}), 400, "max_new_tokens"),
    (*gen({"seed": 2**70}), 400, "seed"),
    (*gen({}, return_logprob=True, logprob_start_len=2**70), 400, "logprob_start_len"),
    (*gen({"max_new_tokens": "4"}), 400, "max_new_tokens"),
    (*gen({"min_new_tokens": 10**6}), 400, "min_new_tokens"),
    (*raw("/generate", '{"text": "\\ud800 hi"}'), 400, "surrogate"),
    (*raw("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}'), 400, "messages[0].content"),
    (*raw("/generate", '{"text": "hi", "sampling_params": {"stop": ["\\ud83d"]}}'), 400, "stop[0]"),
    (*raw("/generate", '{"text": "hi", "rid": "\\ud800"}'), 400, "rid"),
    (*raw("/generate", "[" * 10000 + "]" * 10000), 400, "nested too deeply"),
    (*raw("/v1/completions", '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"), 400, "nested too deeply"),
    (*raw("/generate", '{"text": "hi", "sampling_params": {"temperature": NaN}}'), 400, "temperature"),
    (*raw("/generate", '{"text": "hi", "sampling_params": {"temperature": Infinity}}'), 400, "temperature"),
    (*raw("/generate", '{"text": "hi", "sampling_params": {"temperature": 1e999}}'), 400, "temperature"),
    (*raw("/generate", '{"text": "hi", "sampling_params": {"repetition_penalty": NaN}}'), 400, "repetition_penalty"),
    (*gen({"repetition_penalty": 1e-300}), 400, "repetition_penalty"),  # 0 in float32: logits / 0
    (*gen({}, stream="yes"), 400, "stream"),
    (*gen({}, return_text_in_logprobs=1), 400, "return_text_in_logprobs"),
    (*raw("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}'), 400, "top_p"),
    (*chat(temperature="0.5"), 400, "temperature"),
    (*chat(n=True), 400, "n"),
    (*chat(max_tokens=2**70), 400, "max_tokens"),
    (*chat(seed=2**70), 400, "seed"),
    (*chat(chat_template_kwargs={"tokenize": True}), 400, "tokenize"),
    (*chat(chat_template_kwargs={"chat_template": "{% for i in range(99999) %}{% endfor %}"}), 400, "chat_template"),
    (*chat(chat_template_kwargs={"enable_thinking": False}), 200, None),  # unknown to this template: dropped
    (*chat(messages=[{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                     {"role": "tool", "content": "c"}]), 200, None),
    ("/v1/completions", {"prompt": ["a"] * 100, "n": 64, "max_tokens": 1}, 400, "--max-sequences-per-request"),
    (*gen({"stop": ["x" * 500] * 2000}), 400, "--max-stop-strings"),
    (*gen({"stop": ["x" * 5000]}), 400, "--max-stop-string-length"),
    (*gen({}, return_logprob=True, top_logprobs_num=21), 400, "top_logprobs_num"),
    ("/generate", {"text": "x " * 2_600_000}, 400, "context length"),  # refused before tokenizing 5 MB
    ("/generate", {"input_ids": [[]]}, 400, "empty"),
    ("/generate", {"input_ids": []}, 400, "input_ids"),
    ("/v1/completions", {"prompt": [[1, 2, 10**9]]}, 400, "input_ids"),
    ("/v1/responses", {"input": "hi", "temperature": "0.5"}, 400, "temperature"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input_image"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function", "name": "nope"},
                       "tools": [{"type": "function", "name": "f"}]}, 400, "nope"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "x" * 100_000}, 404, "not found"),
    ("/v1/responses", {"input": [{"type": "reasoning"}]}, 400, "no message"),
    ("/v1/responses", {"input": "x " * 9000, "max_output_tokens": 10}, 400, "context length"),
    ("/nope", {}, 404, "Not Found"),
    ("/v1/models", {}, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize("path,body,status,words", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_hostile_request_gets_a_clear_answer(http, path, body, status, words):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text[:500]
    if status != 200:
        err = r.json()["error"]
        assert words in err["message"] and err["code"] == status and err["type"], err
    assert http.get("/health").status_code == 200


def test_metrics_when_off_name_the_flag(http):
    r = http.get("/metrics")
    assert r.status_code == 404 and "--enable-metrics" in r.json()["error"]["message"]


def test_grammar_edge_cases(http):
    def one(sp: dict) -> dict:
        r = http.post("/generate", json={"text": "Write dragons:", "sampling_params": {"temperature": 0, **sp}})
        assert r.status_code in (200, 400), r.text
        return r.json()

    # a forced string that ends inside a 4-byte character (this once killed the scheduler)
    out = one({"regex": "🐲*", "max_new_tokens": 16})
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert re.fullmatch("🐲*\ufffd?", out["text"]), out["text"]  # whole dragons; at most a cut last one
    out = one({"regex": "(🐲|🦄){2,4}", "max_new_tokens": 24})
    assert re.fullmatch("(🐲|🦄){2,4}", out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"
    schema = {"type": "object", "properties": {"mood": {"type": "string", "pattern": "^[😀-😆]{1,3}$"}},
              "required": ["mood"]}
    out = one({"json_schema": json.dumps(schema), "max_new_tokens": 40})
    assert re.fullmatch("[😀-😆]{1,3}", json.loads(out["text"])["mood"])
    out = one({"regex": "", "max_new_tokens": 8})  # the empty language: only the end
    assert out["text"] == "" and out["meta_info"]["finish_reason"]["type"] == "stop"
    out = one({"regex": "(a+)+$", "max_new_tokens": 8})  # catastrophic for a backtracking engine, not here
    assert re.fullmatch("a*", out["text"])
    t = time.monotonic()
    out = one({"regex": "((a|b){1,30}){1,30}(c|d){1,30}x", "max_new_tokens": 8})  # compiles in bounded time
    assert time.monotonic() - t < 30
    # masks of 40 ms (llguidance) and no completion within any budget: a closing search is bounded by a count of
    # masks, and past its safety net in seconds it fails the request loudly instead of changing its output (once,
    # 400 masks a search held the scheduler for minutes); a machine that computes its 1000 masks in time cuts it
    t = time.monotonic()
    out = one({"regex": "a{99999}", "max_new_tokens": 64})
    assert time.monotonic() - t < 60
    if "error" in out:
        assert "closing the output took over" in out["error"]["message"], out
    else:
        assert out["meta_info"]["finish_reason"]["type"] == "length", out
    # a compile that would run for minutes (xgrammar) or past llguidance's limits: xgrammar's worker is
    # killed at its share of --grammar-compile-timeout (5 s here), llguidance refuses, and the grammars
    # after it compile (once, two of these held both compile threads, and the server's grammars, for good)
    r = http.post("/generate", json={"text": "Go:", "sampling_params": {
        "max_new_tokens": 4, "ebnf": "root ::= " + " ".join(['"a"?'] * 5000)}})
    assert r.status_code == 400 and "did not compile within" in r.json()["error"]["message"], r.text
    # one whose first mask llguidance computes, but whose first token takes it past its limits: a 400 naming
    # the limit (its matcher once refused the token its own mask allowed, and the request ended as an abort)
    r = http.post("/generate", json={"text": "Pick:", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ebnf": "root ::= " + " ".join(f'"x{i}"?' for i in range(5000))}})
    assert r.status_code == 400 and "llguidance" in r.json()["error"]["message"], r.text
    out = one({"regex": "[0-9]{3}", "max_new_tokens": 8})
    assert re.fullmatch("[0-9]{3}", out["text"]), out
    assert http.get("/health").status_code == 200


def test_refused_requests_leave_no_queue_slot_behind(http):
    # 4 running + 0 queued allowed: a leaked slot per refusal would turn the next requests into 429s
    for _ in range(6):
        r = http.post("/generate", content='{"text": "hi", "rid": "\\ud800"}'.encode(),
                      headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = http.post("/generate", json={"text": "hi", "sampling_params": {"stop": ["a"] * 100}})
        assert r.status_code == 400
    info = http.get("/server_info").json()
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    ok = [http.post("/generate", json={"text": f"{i}", "sampling_params": {"max_new_tokens": 2}}) for i in range(5)]
    assert [r.status_code for r in ok] == [200] * 5


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "Tell me a long story.", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A long story."}], "n": 2,
                              "max_tokens": 3000, "ignore_eos": True}),
])
def test_non_streaming_request_is_aborted_when_its_client_leaves(server, http, path, body):
    before = http.get("/server_info").json()["tokens_generated"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + path, json=body, headers=server.headers, timeout=1.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = http.get("/server_info").json()
        if info["num_running"] == 0:
            break
        time.sleep(0.2)
    assert info["num_running"] == 0 and info["kv_check"] == "ok", info
    assert info["tokens_generated"] - before < 500


def test_browser_and_key_handling(server):
    url = server.url
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(url + "/generate", json=body).status_code == 401
    assert httpx.post(url + "/generate", json=body, headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401
    # a web page elsewhere (a simple text/plain POST needs no preflight) and DNS rebinding are refused
    foreign = httpx.post(url + "/generate", content=json.dumps(body), headers={
        "Authorization": f"Bearer {KEY}", "Origin": "http://evil.example", "content-type": "text/plain"})
    assert foreign.status_code == 403 and "origin" in foreign.json()["error"]["message"]
    rebound = httpx.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}",
                                                                "Host": "evil.example"})
    assert rebound.status_code == 403 and "host" in rebound.json()["error"]["message"]
    assert httpx.get(url + "/health", headers={"Host": f"localhost:{server.port}"}).status_code == 200
    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()
    # a body without Content-Length is bounded too (413 from the limit, not the endpoint's parse)
    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"x" * 2**20
        yield b'"}]}'
    r = httpx.post(url + "/v1/chat/completions", content=chunks(), timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_sigterm_drains_then_ends_the_rest_with_an_error(server):
    """Runs last in this module: the server stops. --shutdown-timeout is 3 s: a short request in
    flight finishes; a long stream is ended with an error event and [DONE]; the exit code is 0."""
    results: dict = {}

    def short():
        r = httpx.post(server.url + "/generate", headers=server.headers, timeout=60,
                       json={"text": "Count: 1, 2,", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        results["short"] = r.status_code

    def long_stream():
        events = []
        with httpx.stream("POST", server.url + "/generate", headers=server.headers, timeout=60,
                          json={"text": "A long story", "stream": True,
                                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        results["long"] = events

    threads = [threading.Thread(target=long_stream), threading.Thread(target=short)]
    threads[0].start()
    time.sleep(1.0)
    threads[1].start()
    time.sleep(0.3)
    t = time.monotonic()
    code = server.stop(signal.SIGTERM, timeout=30)
    for th in threads:
        th.join(30)
    assert code == 0
    assert results["short"] == 200
    events = results["long"]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]
    assert len(events) > 3 and time.monotonic() - t < 15
