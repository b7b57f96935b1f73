"""Mixture-of-experts kernels: each Triton kernel (run by Triton's interpreter on CPU) against its torch
reference, the alignment's invariants, and the CPU path against the reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from plait.kernels.fused_moe import (fused_experts_cpu, fused_experts_ref, fused_moe, moe_align_block_size_ref,
                                     topk_routing_ref)

# (tokens, experts, top_k): one token, fewer tokens than a block, many experts, top-k 1, 2 and 8
SHAPES = [(1, 8, 2), (3, 4, 1), (7, 16, 8), (40, 64, 8), (5, 60, 4), (64, 128, 2)]


def _weights(experts: int, h: int, inter: int, dtype: torch.dtype, g: torch.Generator):
    w13 = (torch.randn(experts, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(experts, h, inter, generator=g) / inter**0.5).to(dtype)
    return w13, w2


def test_routing_reference_follows_its_definition():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 8, generator=g)
    w, ids = topk_routing_ref(logits, 2, renormalize=True)
    # Mixtral's routing: the softmax over the two largest logits
    top = logits.topk(2, -1)
    assert torch.equal(ids.long(), top.indices) and ids.dtype == torch.int32
    torch.testing.assert_close(w, top.values.softmax(-1))
    w, _ = topk_routing_ref(logits, 2, renormalize=False)
    torch.testing.assert_close(w, logits.softmax(-1).gather(1, top.indices))
    # groups: experts 0-3 and 4-7; with one group allowed, all picks come from the group holding the best expert
    w, ids = topk_routing_ref(logits, 3, True, "sigmoid", num_expert_group=2, topk_group=1)
    best_group = logits.argmax(-1) // 4
    assert torch.equal(ids.long() // 4, best_group[:, None].expand(-1, 3))
    # a correction bias moves the choice, not the weights
    bias = torch.zeros(8)
    bias[7] = 100.0
    w, ids = topk_routing_ref(logits, 1, False, "sigmoid", correction_bias=bias)
    assert (ids == 7).all() and torch.allclose(w[:, 0], logits[:, 7].sigmoid())
    for bad, match in [(dict(top_k=9), "top_k"), (dict(top_k=2, scoring_func="tanh"), "scoring_func"),
                       (dict(top_k=2, num_expert_group=3, topk_group=1), "num_expert_group")]:
        with pytest.raises(ValueError, match=match):
            topk_routing_ref(logits, renormalize=True, **bad)


@pytest.mark.parametrize("block", [1, 4, 16, 64])
def test_align_block_size_invariants(block):
    g = torch.Generator().manual_seed(block)
    for tokens, experts, top_k in SHAPES:
        ids = torch.randint(0, experts, (tokens, top_k), generator=g, dtype=torch.int32)
        ids[0, 0] = -1  # an expert on another rank: dropped
        sorted_ids, expert_ids, post_pad = moe_align_block_size_ref(ids, block, experts)
        pairs, used = ids.numel(), int(post_pad[0])
        assert used % block == 0 and sorted_ids.numel() >= used and sorted_ids.numel() % block == 0
        flat = ids.view(-1)
        real = sorted_ids[:used][sorted_ids[:used] < pairs]
        # every local pair exactly once; the padding is the sentinel
        assert sorted(real.tolist()) == [i for i in range(pairs) if flat[i] >= 0]
        assert (sorted_ids[used:] == pairs).all()
        for b in range(used // block):  # each block: one expert, its pairs in their order
            chunk = sorted_ids[b * block : (b + 1) * block]
            chunk = chunk[chunk < pairs]
            assert chunk.numel() and (flat[chunk.long()] == expert_ids[b]).all()
            assert chunk.tolist() == sorted(chunk.tolist())
        assert (expert_ids[used // block :] == -1).all()
        assert expert_ids[: used // block].tolist() == sorted(expert_ids[: used // block].tolist())
        # no expert takes more blocks than its pairs need
        counts = torch.bincount(flat[flat >= 0].long(), minlength=experts)
        assert used == int(((counts + block - 1) // block * block).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_experts_match_reference(dtype):
    g = torch.Generator().manual_seed(3)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for tokens, experts, top_k in SHAPES:
        w13, w2 = _weights(experts, 32, 48, dtype, g)
        x = torch.randn(tokens, 32, generator=g).to(dtype)
        w, ids = topk_routing_ref(torch.randn(tokens, experts, generator=g), top_k, True)
        ids[0, -1] = -1  # another rank's expert contributes nothing
        ref = fused_experts_ref(x, w13, w2, w, ids)
        torch.testing.assert_close(fused_experts_cpu(x, w13, w2, w, ids).float(), ref.float(), **tol)
        torch.testing.assert_close(fused_experts_cpu(x, w13, w2, w, ids, "gelu").float(),
                                   fused_experts_ref(x, w13, w2, w, ids, "gelu").float(), **tol)
    with pytest.raises(ValueError, match="activation"):
        fused_experts_cpu(x, w13, w2, w, ids, "relu")
    with pytest.raises(ValueError, match="shapes"):
        fused_experts_cpu(x, w13, w2[:, :, :-1], w, ids)


def test_expert_map_splits_the_sum_across_ranks():
    """Expert parallelism: two ranks holding half the experts each sum to the one-rank output."""
    g = torch.Generator().manual_seed(4)
    experts, top_k = 8, 2
    w13, w2 = _weights(experts, 32, 16, torch.float32, g)
    x, logits = torch.randn(9, 32, generator=g), torch.randn(9, experts, generator=g)
    whole = fused_moe(x, w13, w2, logits, top_k, True)
    parts = []
    for rank in range(2):
        mine = torch.arange(experts) // 4 == rank
        expert_map = torch.full((experts,), -1, dtype=torch.int32)
        expert_map[mine] = torch.arange(4, dtype=torch.int32)
        parts.append(fused_moe(x, w13[mine], w2[mine], logits, top_k, True, expert_map=expert_map))
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


_TRITON_MOE = r'''
import torch
from plait.kernels.fused_moe import (fused_experts_ref, fused_experts_triton, moe_align_block_size_ref,
                                     moe_align_block_size_triton, topk_routing_ref, topk_routing_triton)
from plait.kernels.fused_moe.grouped_gemm import moe_gemm_ref, moe_gemm_triton
SHAPES = __SHAPES__
g = torch.Generator().manual_seed(0)
for tokens, experts, top_k in SHAPES:
    logits = torch.randn(tokens, experts, generator=g)
    for scoring in ("softmax", "sigmoid"):
        for renorm in (True, False):
            a, b = (f(logits, top_k, renorm, scoring) for f in (topk_routing_ref, topk_routing_triton))
            assert torch.equal(a[1], b[1]), (tokens, experts, top_k, scoring)
            torch.testing.assert_close(a[0], b[0])
    for block in (16, 32):
        ids = torch.randint(0, experts, (tokens, top_k), generator=g, dtype=torch.int32)
        ids[0, 0] = -1
        for x, y in zip(moe_align_block_size_ref(ids, block, experts), moe_align_block_size_triton(ids, block, experts)):
            assert torch.equal(x, y), (tokens, experts, top_k, block)
logits, bias = torch.randn(9, 64, generator=g), torch.randn(64, generator=g) * 0.1
for b in (None, bias):  # grouped top-k (DeepSeek-V3 style with the bias)
    x, y = (f(logits, 6, True, "sigmoid", 8, 3, b) for f in (topk_routing_ref, topk_routing_triton))
    assert torch.equal(x[1], y[1])
    torch.testing.assert_close(x[0], y[0])
for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
    for (tokens, experts, top_k), cfg in zip(SHAPES, [(16, 32, 32), (16, 64, 16), (32, 32, 64)] * 2):
        h, inter = 48, 40  # neither a multiple of the tiles
        x = torch.randn(tokens, h, generator=g).to(dtype)
        w13 = (torch.randn(experts, 2 * inter, h, generator=g) / h**0.5).to(dtype)
        w2 = (torch.randn(experts, h, inter, generator=g) / inter**0.5).to(dtype)
        w, ids = topk_routing_ref(torch.randn(tokens, experts, generator=g), top_k, True)
        ids[0, -1] = -1
        config = dict(zip(("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"), cfg), GROUP_SIZE_M=2)
        s, e, p = moe_align_block_size_ref(ids, config["BLOCK_SIZE_M"], experts)
        c_ref, c_tri = (torch.full((ids.numel(), 2 * inter), 7.0, dtype=dtype) for _ in range(2))
        moe_gemm_ref(x, w13, c_ref, w, s, e, p, top_k, config)
        moe_gemm_triton(x, w13, c_tri, w, s, e, p, top_k, config)
        torch.testing.assert_close(c_tri.float(), c_ref.float(), atol=tol, rtol=tol)
        ref = fused_experts_ref(x, w13, w2, w, ids).float()
        torch.testing.assert_close(fused_experts_triton(x, w13, w2, w, ids, config=config).float(), ref,
                                   atol=tol, rtol=tol)
print("ok")
'''


# the interpreter is slow: by default one token and fewer tokens than a block at top-k 2 and 8; many experts and
# top-k 1 in `make test-slow`
@pytest.mark.parametrize("shapes", [(0, 2), pytest.param((1, 5), marks=pytest.mark.slow)])
def test_triton_moe_kernels_match_torch_references(shapes):
    """Routing, alignment and the grouped GEMM, run by Triton's interpreter on CPU, against the references
    (fp32 and bf16), over one token, fewer tokens than a block, many experts and top-k 1, 2 and 8."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # must be set before triton is imported
    code = _TRITON_MOE.replace("__SHAPES__", repr([SHAPES[i] for i in shapes]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# ---- MoE models end to end ------------------------------------------------------------------
def _tiny_moe(name: str, path) -> "object":
    from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None)
    config = {
        "mixtral": lambda: MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
        "qwen2_moe": lambda: Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                            shared_expert_intermediate_size=80),
        "qwen3_moe": lambda: Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48),
        "olmoe": lambda: OlmoeConfig(**common, num_experts=8, num_experts_per_tok=2),
    }[name]()
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sharper logits than the init's: greedy picks without near-ties
        for p in hf.parameters():
            p.mul_(3.0 if p.dim() > 1 else 1.0)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("name,parallel", [
    ("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {}), ("olmoe", {}),
    # split over two ranks (processes, gloo): Qwen2-MoE's shared expert and dense layer, OLMoE's q/k norm over
    # all heads (reduced across ranks); --ep-size 2 alone splits attention over the same ranks
    ("qwen2_moe", {"tp_size": 2}), ("qwen2_moe", {"ep_size": 2}), ("olmoe", {"tp_size": 2}),
])
def test_moe_models_greedy_tokens_match_transformers(name, parallel, tmp_path):
    """Several prompts in flight (continuous batching, chunked prefill): the greedy tokens are transformers',
    on one rank and split across two (tensor or expert parallelism)."""
    from plait import Engine

    from conftest import THREADS

    hf = _tiny_moe(name, tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (5, 23, 40)]
    refs = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            refs.append(out[0, len(ids):].tolist())
    engine = Engine(model_path=str(tmp_path), skip_tokenizer_init=True, dtype="float32",
                    num_threads=0 if parallel else THREADS, max_total_tokens=1024, chunked_prefill_size=16,
                    log_level="warning", **parallel)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                                    "ignore_eos": True})
        assert engine.get_server_info()["tp_size"] == (2 if parallel else 1)
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in outs] == refs
