"""Our forward equals transformers' logits (fp32, max abs diff < 1e-3): the default model, and tiny
random-weight configs of every supported architecture loaded from HF folders (sharded too)."""

import pytest
import torch

from plait.runtime.forward.batch import ForwardMode
from plait.runtime.model_executor.model_runner import ModelRunner, WorkItem
from plait.runtime.server_args import ServerArgs

from conftest import THREADS

TOL = 1e-3


def _run(runner: ModelRunner, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits at every position, computing the prompt in the given chunk sizes (paged prefix reuse)."""
    row = runner.req_to_token.alloc()
    slots = runner.allocator.alloc_extend(-1, 0, len(ids))
    runner.req_to_token.table[row, : len(ids)] = slots
    out, pos = [], 0
    for n in chunks:
        out.append(runner.forward([WorkItem(row, pos, ids[pos : pos + n], list(range(n)))]).logits)
        pos += n
    runner.allocator.free(slots)
    runner.req_to_token.free(row)
    return torch.cat(out)


def test_default_model_matches_transformers(runner, hf_model):
    ids = runner.tokenizer.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of")
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    n = len(ids)
    for chunks in ([n], [5, n - 6, 1], [1] * n):
        ours = _run(runner, ids, chunks)
        assert (ours - ref).abs().max().item() < TOL, chunks


def _tiny_configs():
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, OlmoeConfig,
                              Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    common = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return {
        "llama2": LlamaConfig(**common, tie_word_embeddings=False),
        "llama3-rope-scaling": LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "smollm2-tied": LlamaConfig(**common, tie_word_embeddings=True),
        "mistral": MistralConfig(**common, sliding_window=None),
        "qwen2-qkv-bias": Qwen2Config(**common, tie_word_embeddings=False),
        "qwen3-qk-norm": Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
        # mixture of experts: 8 experts, top 2 (OLMoE: top 8 of 8 would route nothing), sparse layers only
        "mixtral": MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
        # a shared expert with its gate; layer 1 dense (mlp_only_layers)
        "qwen2-moe": Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False),
        "qwen3-moe": Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                    head_dim=32, norm_topk_prob=True),
        # q/k norms over all heads; q, k and v clipped
        "olmoe": OlmoeConfig(**common, num_experts=8, num_experts_per_tok=2, clip_qkv=0.8),
        # every layer slides over the last 12 keys
        "mistral-sliding-window": MistralConfig(**common, sliding_window=12),
        # GeGLU, norms around both sublayers, embedding scale, soft-capped scores and logits; layer 0 slides
        "gemma2": Gemma2Config(**common, head_dim=32, sliding_window=12, query_pre_attn_scalar=24,
                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        # q/k norms, five sliding layers with their own rotary base then a global one (here 3 + 1), linear
        # rope scaling on the global layer
        "gemma3": Gemma3TextConfig(**{**common, "num_hidden_layers": 4}, head_dim=32, sliding_window=12,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                   rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                       "factor": 4.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 1e4}}),
        # fused qkv_proj and gate_up_proj in the checkpoint; LongRoPE's short factors (the prompt is shorter than
        # its original context)
        "phi3-longrope": Phi3Config(**{**common, "max_position_embeddings": 512}, pad_token_id=0, eos_token_id=1,
                                    bos_token_id=1, rope_parameters={
                                        "rope_type": "longrope", "rope_theta": 1e4, "factor": 8.0,
                                        "original_max_position_embeddings": 64,
                                        "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                        "long_factor": [2.0 + 0.1 * i for i in range(8)]}),
    }


@pytest.mark.parametrize("name", list(_tiny_configs()))
def test_tiny_architectures_match_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _tiny_configs()[name]
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # make biases and norms non-trivial
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards + an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    args = ServerArgs(model_path=str(tmp_path), dtype="float32", max_total_tokens=512, num_threads=THREADS,
                      skip_tokenizer_init=True).resolved()
    runner = ModelRunner(args, progress=False)
    sparse = [layer.sparse is not None for layer in runner.model.layers]
    expected = [True, False] if name == "qwen2-moe" else [hasattr(config, "num_experts_per_tok")] * config.num_hidden_layers
    assert sparse == expected, sparse
    ids = torch.randint(0, config.vocab_size, (40,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for chunks in ([40], [17, 22, 1]):
        ours = _run(runner, ids, chunks)
        assert (ours - ref).abs().max().item() < TOL, (name, chunks)


def test_strict_loader_rejects_missing_and_leftover_tensors(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    config = _tiny_configs()["llama2"]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    args = ServerArgs(model_path=str(tmp_path), dtype="float32", max_total_tokens=512,
                      skip_tokenizer_init=True).resolved()

    tensors["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(tensors, file)
    with pytest.raises(ValueError, match="leftover"):
        ModelRunner(args, progress=False)

    del tensors["model.layers.0.extra.weight"], tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match="missing"):
        ModelRunner(args, progress=False)


def test_cascade_decode_over_a_shared_prefix_matches_transformers(runner, hf_model):
    """Decode requests sharing cached prefix slots take the cascade path (prefix read once)."""
    tok = runner.tokenizer
    prefix = tok.encode("Here is a long shared context. " * 12)
    tails = [tok.encode(t) for t in (" First question: why", " Second one: how do", " Third")]
    assert len(prefix) >= 64
    p_slots = runner.allocator.alloc_extend(-1, 0, len(prefix))
    rows, refs, owned = [], [], []
    for tail in tails:
        ids = prefix + tail
        row = runner.req_to_token.alloc()
        own = runner.allocator.alloc_extend(-1, 0, len(tail))
        runner.req_to_token.table[row, : len(ids)] = torch.cat([p_slots, own])
        rows.append(row)
        owned.append(own)
        with torch.no_grad():
            refs.append(hf_model(torch.tensor([ids])).logits[0, -1])
    # prefix once, then each tail's prefill but its last token, then all last tokens as one decode batch
    runner.forward([WorkItem(rows[0], 0, prefix, [])])
    runner.forward([WorkItem(r, len(prefix), t[:-1], []) for r, t in zip(rows, tails) if len(t) > 1])
    batch, _ = runner.build_batch([WorkItem(r, len(prefix) + len(t) - 1, t[-1:], [0], ForwardMode.DECODE) for r, t in zip(rows, tails)])
    assert batch.decode.prefix_slots is not None and len(batch.decode.prefix_slots) >= len(prefix)
    logits = runner.forward([WorkItem(r, len(prefix) + len(t) - 1, t[-1:], [0], ForwardMode.DECODE) for r, t in zip(rows, tails)]).logits
    for k in range(len(tails)):
        assert (logits[k] - refs[k]).abs().max().item() < TOL
    for row, own in zip(rows, owned):
        runner.allocator.free(own)
        runner.req_to_token.free(row)
    runner.allocator.free(p_slots)


def test_bfloat16_weights_track_float32(runner):
    """The bf16 path (unpacked matmuls, bf16 KV) stays close to fp32: a 135M model's near-ties may flip."""
    args = ServerArgs(dtype="bfloat16", max_total_tokens=512, num_threads=THREADS).resolved()
    bf16 = ModelRunner(args, progress=False)
    tok = runner.tokenizer
    ids = tok.encode("The history of Paris begins with a small settlement on an island in the river Seine.")
    ref = _run(runner, ids, [len(ids)])
    ours = _run(bf16, ids, [7, len(ids) - 7])
    assert (ours - ref).abs().max().item() < 2.0
    # wherever bf16 picks another token, fp32 had it as a near-tie
    chosen = ref.gather(1, ours.argmax(-1, keepdim=True)).squeeze(1)
    assert (ref.max(-1).values - chosen).max().item() < 0.5
