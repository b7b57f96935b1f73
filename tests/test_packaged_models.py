"""The models that ship in PyPI packages (runtime/model_loader/packaged.py), against transformers loading the same
GGUF file (float32, its own reader, dequantization and name mapping: an independent reference):

- Gemma-3-270M (Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 tensors; sliding-window layers, GeGLU, q/k norms, a 262k
  vocabulary, no chat template in the file) and Qwen2.5-Coder-0.5B-Instruct (Q4_K_M; qkv bias, its own chat
  template): logits in float32 equal transformers' to 1e-3, across chunked prefill and past the sliding window;
  greedy output through the real server equal to transformers' generate (for Gemma also on a prompt longer than
  its window, computed and then from the cache, its sliding layers keeping only their window); the file's own blocks (the default)
  choose the float32 model's next token almost everywhere.
- Qwen2.5-Coder-1.5B-Instruct (Q4_K/Q6_K, 1.1 GB): the same, in `make test-slow`.
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch

from plait.runtime.model_executor.model_runner import ModelRunner, WorkItem
from plait.runtime.model_loader.packaged import fetch
from plait.runtime.server_args import ServerArgs

from conftest import THREADS, chat_prompt
from server_util import Server

TOL = 1e-3
# a prompt that runs past Gemma 3's 512-key window
LONG = ("The history of the city begins with a small settlement on an island in the river. " * 40
        + "Over the centuries it grew into")


@contextlib.contextmanager
def _one_gguf_parse():
    """transformers reads a GGUF's header twice (config, then weights) with the gguf package's reader, ~18 s each
    for a 262k vocabulary: the second read reuses the first."""
    import gguf

    original = gguf.GGUFReader  # transformers imports it from the package at each call
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(original)
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _reference(path: str):
    from transformers import AutoModelForCausalLM

    with _one_gguf_parse():
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()


def _positions(n: int) -> list[int]:
    """The positions whose logits are compared: every 16th and the last (a 262k-word LM head at all of them
    would cost more than the rest of the forward)."""
    return sorted(set(range(0, n, 16)) | {n - 1})


def _run(runner: ModelRunner, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits at `_positions`, the prompt computed in the given chunk sizes."""
    row = runner.req_to_token.alloc()
    slots = runner.allocator.alloc_extend(-1, 0, len(ids))
    runner.req_to_token.table[row, : len(ids)] = slots
    out, pos, wanted = [], 0, set(_positions(len(ids)))
    try:
        for n in chunks:
            offsets = [i for i in range(n) if pos + i in wanted]
            out.append(runner.forward([WorkItem(row, pos, ids[pos : pos + n], offsets)]).logits)
            pos += n
    finally:
        runner.allocator.free(slots)
        runner.req_to_token.free(row)
    return torch.cat(out)


def _runner(name: str, **kw) -> ModelRunner:
    args = ServerArgs(model_path=name, max_total_tokens=2048, max_running_requests=4, num_threads=THREADS,
                      **kw).resolved()
    return ModelRunner(args, progress=False)


def _check_model(name: str, prompts: list[str]) -> None:
    path = str(fetch(name))
    ours = _runner(name, dtype="float32")
    tok, stops = ours.tokenizer, list(ours.config.eos_token_ids)
    ids = tok.encode(LONG)
    n = len(ids)
    assert n > 600
    ref_model = _reference(path)
    with torch.no_grad():
        hidden = ref_model.model(torch.tensor([ids])).last_hidden_state[0, _positions(n)]
        ref = ref_model.lm_head(hidden)
    for chunks in ([n], [7, n - 8, 1]):
        diff = (_run(ours, ids, chunks) - ref).abs().max().item()
        assert diff < TOL, (name, chunks, diff)
    # the file's own blocks (the default) pick the float32 model's next token almost everywhere
    blocks = _runner(name, quantization="auto", kv_cache_dtype="float32", disable_packed_weights=True)
    assert any(f in blocks.weight_formats for f in ("q4_k", "q5_0", "q4_k+q6_k")), blocks.weight_formats
    agree = (_run(blocks, ids, [n]).argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, (name, blocks.weight_formats, agree)
    del ours, blocks
    # greedy decoding through the server: the chat template is the file's (a fallback for Gemma, whose file has
    # none), and the output is transformers' own greedy continuation of the same prompt ids
    server = Server("--model-path", name, "--dtype", "float32", "--grammar-backend", "none", "--max-total-tokens", "4096")
    try:
        with server.client() as http:
            for q in prompts:
                prompt = chat_prompt(tok, q)
                prompt_ids = tok.encode(prompt, add_special_tokens=False)
                with torch.no_grad():
                    gen = ref_model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
                                             eos_token_id=stops, pad_token_id=stops[0])
                want = gen[0, len(prompt_ids):].tolist()
                r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": q}],
                                                             "max_tokens": 24, "temperature": 0})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["usage"]["prompt_tokens"] == len(prompt_ids)
                text = tok.decode([t for t in want if t not in stops], skip_special_tokens=True)
                assert body["choices"][0]["message"]["content"] == text, (q, want)
            if ref_model.config.sliding_window and ref_model.config.sliding_window < n:
                _check_past_the_window(http, ref_model, ids, stops)
    finally:
        server.stop()


def _check_past_the_window(http, ref_model, ids: list[int], stops: list[int]) -> None:
    """A prompt longer than the sliding window, twice (the second from the cache): transformers' greedy continuation
    both times, with the sliding-window layers keeping only their window."""
    info = http.get("/server_info").json()
    assert 0 < info["kv_window_capacity"] < info["kv_capacity"], info
    with torch.no_grad():
        gen = ref_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=stops,
                                 pad_token_id=stops[0])
    want = [t for t in gen[0, len(ids):].tolist() if t not in stops]
    for _ in range(2):
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
        assert r.status_code == 200, r.text
        assert [t for t in r.json()["output_ids"] if t not in stops] == want
    assert r.json()["meta_info"]["cached_tokens"] > len(ids) - 16


@pytest.mark.slow  # the tiny random configs cover the architectures in the default run
def test_gemma3_270m_matches_transformers():
    _check_model("gemma-3-270m", ["Name three colours of the rainbow.", "What is 12 times 11?"])


@pytest.mark.slow  # the tiny random configs cover the architectures in the default run
def test_qwen25_coder_05b_matches_transformers():
    _check_model("qwen2.5-coder-0.5b", ["Write a Python function that returns the square of a number."])


@pytest.mark.slow
def test_qwen25_coder_15b_matches_transformers():
    _check_model("qwen2.5-coder-1.5b", ["Write a Python function that checks whether a string is a palindrome.",
                                        "Explain what a hash map is in one sentence."])


def test_the_gemma_file_has_no_template_and_gets_gemmas_turns():
    from plait.runtime.model_loader import load_tokenizer

    tok = load_tokenizer(str(fetch("gemma-3-270m")))
    text = chat_prompt(tok, "Hi")
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    qwen = load_tokenizer(str(fetch("qwen2.5-coder-0.5b")))
    assert chat_prompt(qwen, "Hi").startswith("<|im_start|>system\nYou are Qwen")  # the file's own template
