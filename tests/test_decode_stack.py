"""Decode steps run the whole layer stack as one C call (kernels/decode_layers.c) where every layer fits it: the
same kernels as the Python layer loop, in the same order, so the logits are the loop's bit for bit. Checked on
tiny random architectures with block weights (Llama, Qwen 2's qkv bias, Mistral's sliding window, Gemma 2's
sandwich norms, GeGLU, soft caps and window-only KV, Gemma 3's and Qwen3's per-head q/k norms and Gemma 3's local
rotary base), on the default model, and on the packaged Qwen 2.5 Q4_K_M file (q and k in Q4_K beside v in Q6_K: a
projection in parts); and where a layer does not fit (OLMoE's experts), the loop runs.
"""

from __future__ import annotations

import random

import pytest
import torch

from plait.kernels import cpu_build
from plait.runtime.forward.batch import ForwardMode
from plait.runtime.model_executor.model_runner import ModelRunner, WorkItem
from plait.runtime.model_loader.packaged import fetch
from plait.runtime.server_args import ServerArgs

from conftest import THREADS
from test_model_logits import _tiny_configs


needs_c = pytest.mark.skipif(not cpu_build.c_kernels_possible(), reason="no C kernels here (PLAIT_CPU_ISA=ref or no "
                              "compiler): every step runs the loop")


def _runner(model_path: str | None, **kw) -> ModelRunner:
    args = ServerArgs(model_path=model_path, num_threads=THREADS, max_total_tokens=4096, max_running_requests=8,
                      skip_tokenizer_init=model_path is not None and "tiny" in model_path, **kw).resolved()
    return ModelRunner(args, progress=False)


def _decode(runner: ModelRunner, prompts: list[list[int]], steps: int, stack: bool) -> torch.Tensor:
    """Logits of `steps` decode steps of all prompts in one batch, with the C stack or the Python loop."""
    saved = runner.model.graph
    runner.model.graph = saved if stack else None
    rows = []
    try:
        for p in prompts:
            row = runner.req_to_token.alloc()
            runner.req_to_token.table[row, : len(p) + steps] = runner.allocator.alloc_extend(-1, 0, len(p) + steps)
            rows.append((row, len(p)))
            runner.forward([WorkItem(row, 0, p, [len(p) - 1])])
        rng = random.Random(0)
        out = []
        for s in range(steps):
            items = [WorkItem(row, n + s, [rng.randrange(100)], [0], ForwardMode.DECODE) for row, n in rows]
            out.append(runner.forward(items).logits)
        return torch.stack(out)
    finally:
        runner.model.graph = saved
        for (row, n) in rows:
            runner.allocator.free(runner.req_to_token.table[row, : n + steps].clone())
            runner.req_to_token.free(row)


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    paths = {}
    for name in ("llama2", "qwen2-qkv-bias", "mistral-sliding-window", "gemma2", "gemma3", "qwen3-qk-norm", "olmoe"):
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(_tiny_configs()[name]).eval()
        with torch.no_grad():  # non-trivial biases and norms
            for p in hf.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        paths[name] = tmp_path_factory.mktemp(f"tiny-{name}")
        hf.save_pretrained(paths[name])
    return paths


@needs_c
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama2", "qwen2-qkv-bias", "mistral-sliding-window", "gemma2", "gemma3",
                                  "qwen3-qk-norm"])
def test_the_c_stack_gives_the_loops_logits_bit_for_bit(tiny_models, name, quantization):
    runner = _runner(str(tiny_models[name]), quantization=quantization)
    assert runner.model.graph is not None
    if name.startswith("gemma"):
        assert runner.window_layers  # sliding layers read their window slots (ForwardBatch.windowed)
    # three requests of different lengths, decoding past the window of 12
    prompts = _prompts(160, [5, 17, 30])
    stack, loop = _decode(runner, prompts, 20, True), _decode(runner, prompts, 20, False)
    assert torch.equal(stack, loop), (stack - loop).abs().max()
    assert torch.isfinite(stack).all()


def test_a_layer_the_stack_does_not_do_runs_the_loop(tiny_models):
    runner = _runner(str(tiny_models["olmoe"]), quantization="int8")
    assert runner.model.graph is None  # experts; q/k norms over all heads; clipping
    assert torch.isfinite(_decode(runner, _prompts(160, [9]), 3, False)).all()
    flagged = _runner(str(tiny_models["llama2"]), quantization="int8", disable_native_decode=True)
    assert flagged.model.graph is None


@needs_c
def test_the_default_model_decodes_through_the_stack_with_the_loops_logits():
    runner = _runner(None)
    assert runner.model.graph is not None and "q4_1" in runner.weight_formats
    # 12 rows: past 8, block matmuls that need not be batch-invariant decode each weight tile to bfloat16 once
    prompts = _prompts(30000, [40, 7, 90, 23, 5, 61, 12, 33, 8, 19, 70, 2])
    for batch in (prompts[:1], prompts[:4], prompts):
        assert torch.equal(_decode(runner, batch, 6, True), _decode(runner, batch, 6, False))


@needs_c
def test_a_projection_in_several_formats_runs_in_parts():
    runner = _runner(str(fetch("qwen2.5-coder-0.5b")))
    qkv = runner.model.graph.stack.layers[0].qkv
    assert len(qkv.parts) > 1 and qkv.bias is not None  # Q4_K q and k beside Q6_K v; the qkv bias after them
    prompts = _prompts(30000, [33, 12])
    assert torch.equal(_decode(runner, prompts, 5, True), _decode(runner, prompts, 5, False))


class Counting:
    """The C stack as a graph runner that records the rows of each step it runs."""

    name = "counting"

    def __init__(self, native):
        self.native, self.calls = native, []

    def takes(self, fb):
        return self.native.takes(fb)

    def run(self, x, fb, rope):
        self.calls.append(fb.num_tokens)
        return self.native.run(x, fb, rope)


@needs_c
def test_a_registered_graph_runner_takes_the_steps_it_claims(monkeypatch):
    from plait.runtime.model_executor import graph_runner

    runner = _runner(None)
    counting = Counting(runner.model.graph)
    calls = counting.calls
    monkeypatch.setattr(graph_runner, "GRAPH_RUNNERS",
                        {"declines": lambda model, pool: None, "counting": lambda model, pool: counting,
                         **graph_runner.GRAPH_RUNNERS})
    runner.model.graph = graph_runner.build_graph_runner(runner.model, runner.kv_pool)
    assert runner.model.graph.name == "counting"
    prompts = _prompts(30000, [21, 8])
    assert torch.equal(_decode(runner, prompts, 3, True), _decode(runner, prompts, 3, False))
    assert calls == [2, 2, 2]  # the decode steps, not the prefills


def _verify(runner: ModelRunner, prompt: list[int], tokens: list[int], tree: list[int] | None, stack: bool,
            decode: list[int] | None = None) -> torch.Tensor:
    """Logits at every token of one TARGET_VERIFY item over a prefilled prompt (beside a decode item when `decode`
    gives a second prompt), with the C stack or the loop."""
    saved = runner.model.graph
    runner.model.graph = saved if stack else None
    rows = []
    try:
        items = []
        for p, toks, mode in ((prompt, tokens, ForwardMode.TARGET_VERIFY), (decode, [7], ForwardMode.DECODE)):
            if p is None:
                continue
            row = runner.req_to_token.alloc()
            runner.req_to_token.table[row, : len(p) + len(toks)] = runner.allocator.alloc_extend(-1, 0,
                                                                                                 len(p) + len(toks))
            rows.append((row, len(p) + len(toks)))
            runner.forward([WorkItem(row, 0, p, [len(p) - 1])])
            items.append(WorkItem(row, len(p), toks, list(range(len(toks))), mode,
                                  tree if mode is ForwardMode.TARGET_VERIFY else None))
        return runner.forward(items).logits
    finally:
        runner.model.graph = saved
        for row, n in rows:
            runner.allocator.free(runner.req_to_token.table[row, :n].clone())
            runner.req_to_token.free(row)


@needs_c
def test_verify_steps_run_through_the_stack():
    """A draft's verify forward is rows of the stack like decode tokens: a chain's logits are those of decoding its
    tokens one step at a time, and a tree's (each node sees its ancestors only) and a verify beside a decode item
    agree with the loop's."""
    runner = _runner(None)
    runner.model.graph = Counting(runner.model.graph)
    calls = runner.model.graph.calls
    prompt, other = _prompts(30000, [40, 17])
    chain = [11, 2024, 305, 9, 77]
    verify = _verify(runner, prompt, chain, None, True)
    assert calls == [5]
    row = runner.req_to_token.alloc()
    runner.req_to_token.table[row, : len(prompt) + len(chain)] = runner.allocator.alloc_extend(-1, 0, len(prompt) + 5)
    runner.forward([WorkItem(row, 0, prompt, [len(prompt) - 1])])
    steps = torch.cat([runner.forward([WorkItem(row, len(prompt) + i, [t], [0], ForwardMode.DECODE)]).logits
                       for i, t in enumerate(chain)])
    torch.testing.assert_close(verify, steps, rtol=0, atol=1e-4)
    # two children of the sampled token, one grandchild under each: the path 11, 2024, 305 is the chain's start
    tokens, tree = [11, 2024, 9, 305, 77], [-1, -1, 0, 1]
    calls.clear()
    got, ref = _verify(runner, prompt, tokens, tree, True), _verify(runner, prompt, tokens, tree, False)
    assert calls == [5]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-3)
    torch.testing.assert_close(got[[0, 1, 3]], verify[[0, 1, 2]], rtol=0, atol=1e-4)
    calls.clear()
    got, ref = _verify(runner, prompt, chain, None, True, other), _verify(runner, prompt, chain, None, False, other)
    assert calls == [6]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-3)
    torch.testing.assert_close(got[:5], verify, rtol=0, atol=1e-4)
