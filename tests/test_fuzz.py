"""Fuzzing the real server, seeded and bounded: schemathesis from the server's own OpenAPI schema,
and hypothesis over bodies and sampling parameters (types, NaN/inf, huge ints, lone surrogates,
out-of-vocab ids, empty and oversize inputs) and over regexes and schemas with non-ASCII and
non-BMP characters. Every answer is a 4xx with an OpenAI-style body or a correct 200; never a
5xx, never a hang; the server is healthy and its KV accounting consistent afterwards.

The default run is short (CI); `make test-slow` runs the long one (PLAIT_FUZZ_SCALE=10)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_util import Server

SCALE = int(os.environ.get("PLAIT_FUZZ_SCALE", "1"))
FUZZ_SETTINGS = settings(max_examples=40 * SCALE, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(HealthCheck))
# each example compiles a new grammar: fewer of them by default
GRAMMAR_FUZZ_SETTINGS = settings(FUZZ_SETTINGS, max_examples=24 * SCALE)


@pytest.fixture(scope="module")
def server():
    # short contexts and a small token budget keep every accepted request to a second or two
    srv = Server("--max-total-tokens", "8192", "--context-length", "256", "--max-new-tokens-per-request", "16",
                 "--grammar-compile-timeout", "10")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def http(server):
    with server.client(timeout=120) as c:
        yield c


def _check_answer(r: httpx.Response) -> None:
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["code"] == r.status_code and err["type"], err


def _post(http: httpx.Client, path: str, body) -> httpx.Response:
    # json.dumps writes NaN, Infinity, huge ints and lone surrogates (as escapes): all reach the server
    r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    _check_answer(r)
    return r


# ---- strategies ---------------------------------------------------------------------------------
_odd_text = st.sampled_from(["", "\ud800", "a\udfff", "🐲", "\x00", "é" * 3, "x" * 3000, "<|im_end|>", "\n"])
text = st.one_of(st.text(max_size=40), _odd_text)
scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), text,
                   st.lists(st.integers(-5, 60000), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
small_int = st.one_of(st.integers(-2, 20), scalar)
unit = st.one_of(st.floats(-0.5, 2.5), scalar)

SAMPLING = {
    "max_new_tokens": st.one_of(st.integers(0, 6), scalar), "min_new_tokens": small_int, "temperature": unit,
    "top_p": unit, "top_k": st.one_of(st.integers(-2, 100000), scalar), "min_p": unit,
    "repetition_penalty": unit, "frequency_penalty": unit, "presence_penalty": unit,
    "stop": st.one_of(text, st.lists(text, max_size=3), scalar),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 60000), max_size=3), scalar),
    "ignore_eos": st.one_of(st.booleans(), scalar), "skip_special_tokens": st.one_of(st.booleans(), scalar),
    "seed": st.one_of(st.integers(-5, 2**65), scalar), "regex": st.one_of(st.sampled_from(["[a-c]+", "(", "🐲?x"]), scalar),
    "json_schema": st.one_of(st.sampled_from(['{"type": "integer"}', "{", '{"type": "nope"}']), scalar),
    "n": small_int, "bogus": scalar,
}
sampling_params = st.one_of(st.fixed_dictionaries({}, optional=SAMPLING), scalar)

generate_body = st.fixed_dictionaries({}, optional={
    "text": st.one_of(text, st.lists(text, max_size=3), scalar),
    "input_ids": st.one_of(st.lists(st.integers(-3, 60000), max_size=6),
                           st.lists(st.lists(st.integers(0, 49151), max_size=4), max_size=3), scalar),
    "sampling_params": st.one_of(sampling_params, st.lists(sampling_params, max_size=3)),
    "return_logprob": st.one_of(st.booleans(), scalar), "logprob_start_len": small_int,
    "top_logprobs_num": small_int, "stream": st.one_of(st.booleans(), scalar), "rid": st.one_of(text, scalar),
    "return_text_in_logprobs": st.one_of(st.booleans(), scalar),
})

OPENAI = {
    "max_tokens": st.one_of(st.integers(0, 6), scalar), "temperature": unit, "top_p": unit, "n": small_int,
    "stop": st.one_of(text, st.lists(text, max_size=3), scalar), "seed": st.one_of(st.integers(-5, 2**65), scalar),
    "presence_penalty": unit, "frequency_penalty": unit, "logprobs": st.one_of(st.booleans(), small_int),
    "top_k": st.one_of(st.integers(-2, 100000), scalar), "min_p": unit, "repetition_penalty": unit,
    "min_tokens": small_int, "stop_token_ids": st.one_of(st.lists(st.integers(-3, 60000), max_size=3), scalar),
    "stream": st.one_of(st.booleans(), scalar), "logit_bias": scalar,
    "response_format": st.one_of(st.sampled_from([{"type": "json_object"}, {"type": "json_schema"}, {"type": "x"},
                                                   {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}}]),
                                 scalar),
}
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), scalar),
                                 "content": st.one_of(text, scalar,
                                                      st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                                      "text": text}), max_size=2))})
chat_body = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=3), scalar)}, optional={
    **OPENAI, "max_completion_tokens": small_int, "top_logprobs": small_int,
    "chat_template_kwargs": st.one_of(st.dictionaries(st.sampled_from(["tokenize", "enable_thinking", "x", "chat_template"]),
                                                      scalar, max_size=2), scalar),
    "tools": st.one_of(st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]), scalar),
    "tool_choice": st.one_of(st.sampled_from(["auto", "required", "none", {"type": "function", "function": {"name": "f"}}]),
                             scalar),
})
completion_body = st.fixed_dictionaries({"prompt": st.one_of(text, st.lists(text, max_size=3),
                                                             st.lists(st.integers(-3, 60000), max_size=5),
                                                             st.lists(st.lists(st.integers(0, 60000), max_size=3), max_size=3),
                                                             scalar)},
                                        optional={**OPENAI, "echo": st.one_of(st.booleans(), scalar),
                                                  "logprobs": small_int, "suffix": scalar, "best_of": scalar})


# ---- hypothesis over bodies ---------------------------------------------------------------------
@FUZZ_SETTINGS
@given(body=generate_body)
def test_fuzz_generate(http, body):
    r = _post(http, "/generate", body)
    if r.status_code == 200 and not body.get("stream"):
        out = r.json()
        for item in out if isinstance(out, list) else [out]:
            assert isinstance(item["text"], str) and item["meta_info"]["finish_reason"] is not None


@pytest.mark.parametrize("path,bodies", [("/v1/chat/completions", chat_body), ("/v1/completions", completion_body)])
def test_fuzz_openai(http, path, bodies):
    @FUZZ_SETTINGS
    @given(body=bodies)
    def one(body):
        r = _post(http, path, body)
        if r.status_code == 200 and body.get("stream") is not True:
            assert r.json()["choices"]

    one()


# ---- hypothesis over grammars with non-ASCII and non-BMP characters -----------------------------------
ATOMS = ["a", "é", "ß", "🐲", "🦄", "[😀-😆]", "[а-я]", "(x|🐲)", "\\d", "[ -~]", "中文"]
QUANTIFIERS = ["", "", "?", "*", "+", "{1,3}"]
regex = st.lists(st.tuples(st.sampled_from(ATOMS), st.sampled_from(QUANTIFIERS)), min_size=1, max_size=4).map(
    lambda parts: "".join(a if not q else (a if len(a) == 1 or a.startswith(("[", "(")) else f"(?:{a})") + q
                          for a, q in parts))


@GRAMMAR_FUZZ_SETTINGS
@given(pattern=regex)
def test_fuzz_non_bmp_regexes(http, pattern):
    r = _post(http, "/generate", {"text": "Say it:", "sampling_params": {"regex": pattern, "max_new_tokens": 12,
                                                                         "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])


@GRAMMAR_FUZZ_SETTINGS
@given(pattern=regex, enum=st.lists(st.sampled_from(["🐲", "dragon 🐲", "ünïcode", "中文", "😀😀"]), min_size=1, max_size=3,
                                    unique=True))
def test_fuzz_non_bmp_schemas(http, pattern, enum):
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": f"^{pattern}$"}, "e": {"enum": enum}},
              "required": ["e", "p"]}
    r = _post(http, "/generate", {"text": "JSON:", "sampling_params": {"json_schema": json.dumps(schema),
                                                                       "max_new_tokens": 16, "temperature": 0}})
    if r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "stop":
        value = json.loads(r.json()["text"])
        jsonschema.validate(value, schema)


# ---- schemathesis from /openapi.json ------------------------------------------------------------------
def test_schemathesis_finds_no_server_error(server, http, tmp_path):
    exe = shutil.which("schemathesis", path=os.path.dirname(sys.executable))
    assert exe, "schemathesis is a test dependency"
    # one worker: schemathesis' workers are threads, and Hypothesis' strategy reprs are not thread-safe
    # (a shared lambda-source cache and CPython 3.11's AST recursion counter fail under two of them)
    cmd = [exe, "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error", "--seed", "1",
           "--max-time", str(10 * SCALE), "-w", "1", "--request-timeout", "60", "--no-color"]
    # run in a scratch folder: schemathesis keeps a crash cache in its working directory and replays it
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120 + 60 * SCALE, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout


def test_server_is_healthy_and_consistent_after_fuzzing(http):
    assert http.get("/health").status_code == 200
    assert http.post("/flush_cache").status_code == 200
    info = http.get("/server_info").json()
    assert info["kv_check"] == "ok" and info["num_running"] == 0, info
    r = http.post("/generate", json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4,
                                                                                            "temperature": 0}})
    assert r.status_code == 200 and "Paris" in r.json()["text"]


@pytest.mark.slow
def test_long_fuzz_run():
    """`make test-slow`: the same fuzzers at ten times the examples and time."""
    env = {**os.environ, "PLAIT_FUZZ_SCALE": "10"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", __file__], env=env,
                          capture_output=True, text=True, cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, proc.stdout[-6000:]
