"""Two plait servers behind the real sglang-router (PyPI, Rust) with cache-aware routing: every request of a
shared prefix lands on one worker, whose own Prometheus metrics show the cache hits; the router's SGLang
calls (/model_info, /generate with SGLang's extra fields, the OpenAI API) are answered as SGLang answers them."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from server_util import Server, free_port

PREFIXES = [
    "You are a support agent for a bicycle shop. The shop sells road bikes, mountain bikes and repairs. "
    "Opening hours are nine to six on weekdays. Answer briefly. " * 3,
    "The following is a recipe book of soups from northern Italy, with ingredients, steps and serving notes. "
    "Each recipe lists the time it takes and how many people it serves. " * 3,
    "Meeting notes, engineering team, week 12: the release slipped by two days; the database migration is done; "
    "the new hire starts Monday and needs a laptop and accounts. " * 3,
]
QUESTIONS = [" Question one:", " Question two:", " A third question:", " Finally:"]


def _counter(metrics: str, name: str) -> float:
    m = re.search(rf"^plait:{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", metrics, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("sglang_router")
    workers = [Server("--enable-metrics", "--max-total-tokens", "4096") for _ in range(2)]
    port = free_port()
    log = tempfile.TemporaryFile()
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--policy", "cache_aware", "--worker-urls", *[w.url for w in workers], "--log-level", "warn",
         "--prometheus-port", str(free_port())],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert router.poll() is None, log.seek(0) or log.read().decode(errors="replace")[-3000:]
            time.sleep(0.3)
        else:
            raise RuntimeError("the router did not come up")
        yield url, workers
    finally:
        router.terminate()
        router.wait(10)
        for w in workers:
            w.stop()


def test_router_sends_each_prefix_to_one_worker_with_cache_hits(cluster):
    """Each prefix's first request goes out at once (the router places new prefixes by load, so they spread
    over both workers); then each prefix's other requests, one at a time, must all land where it is cached."""
    from concurrent.futures import ThreadPoolExecutor

    url, workers = cluster
    params = {"max_new_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=url, timeout=120) as client:
        def ask(text: str) -> dict:
            r = client.post("/generate", json={"text": text, "sampling_params": params})
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(len(PREFIXES)) as pool:
            list(pool.map(ask, [p + QUESTIONS[0] for p in PREFIXES]))
        served = {}
        for p, prefix in enumerate(PREFIXES):
            before = [httpx.get(w.url + "/metrics").text for w in workers]
            cached = [ask(prefix + q)["meta_info"]["cached_tokens"] for q in QUESTIONS[1:]]
            after = [httpx.get(w.url + "/metrics").text for w in workers]
            took = [_counter(a, "num_requests") - _counter(b, "num_requests") for a, b in zip(after, before)]
            hits = [_counter(a, "cached_tokens") - _counter(b, "cached_tokens") for a, b in zip(after, before)]
            # all on one worker, each reusing the prefix from that worker's cache (its own metrics count them)
            assert sorted(took) == [0, len(cached)], took
            w = took.index(len(cached))
            assert min(cached) > 60 and hits[w] >= sum(cached) and hits[1 - w] == 0, (cached, hits)
            served[p] = w
    assert set(served.values()) == {0, 1}, served


def test_router_openai_and_info_calls(cluster):
    url, workers = cluster
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": models[0]["id"], "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"], chat.text
    info = httpx.get(workers[0].url + "/model_info", timeout=10).json()  # the name the router asks first
    assert info == httpx.get(workers[0].url + "/get_model_info", timeout=10).json()
    # SGLang's extra /generate fields: accepted at their no-op values, refused naming the field otherwise
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "return_hidden_states": False,
            "log_metrics": True, "no_logs": False, "background": False, "return_bytes": False,
            "return_entropy": False}
    assert httpx.post(workers[1].url + "/generate", json=body, timeout=60).status_code == 200
    bad = httpx.post(workers[1].url + "/generate", json=dict(body, return_hidden_states=True), timeout=60)
    assert bad.status_code == 400 and "return_hidden_states" in bad.json()["error"]["message"]
