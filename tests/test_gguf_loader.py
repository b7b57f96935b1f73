"""GGUF loading: a tiny Llama written as llama.cpp writes it (Q/K rows permuted, quantized blocks)
loads to the same logits as transformers on the same dequantized weights."""

import math

import numpy as np
import pytest
import torch

from plait.runtime.model_executor.model_runner import ModelRunner, WorkItem
from plait.runtime.server_args import ServerArgs

from conftest import THREADS

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{LAYER[module]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf permutation
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# the types the gguf package can write (its numpy quantizers have no K-quants; reading them is its dequantizer's)
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_quant_types_match_transformers(tmp_path, qtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    path = str(tmp_path / "tiny.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(256)
    w.add_rope_dimension_count(64)
    state = hf.state_dict()
    for name, t in state.items():
        arr = t.float().numpy()
        if name.endswith("q_proj.weight"):
            arr = _permute(arr, 4)
        elif name.endswith("k_proj.weight"):
            arr = _permute(arr, 2)
        if arr.ndim == 2 and qtype not in (Q.F32, Q.F16):
            data = gguf.quants.quantize(arr, qtype)
            w.add_tensor(_gguf_name(name), data, raw_dtype=qtype)  # byte-shaped blocks
            deq = gguf.quants.dequantize(data, qtype).reshape(arr.shape)
        elif arr.ndim == 2 and qtype == Q.F16:
            w.add_tensor(_gguf_name(name), arr.astype(np.float16))
            deq = arr.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(_gguf_name(name), arr)
            deq = arr
        if name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):  # back to HF layout
            heads = 4 if "q_proj" in name else 2
            deq = deq.reshape(heads, deq.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
        state[name] = torch.from_numpy(np.ascontiguousarray(deq))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf.load_state_dict(state)

    args = ServerArgs(model_path=path, dtype="float32", max_total_tokens=256, num_threads=THREADS,
                      skip_tokenizer_init=True).resolved()
    runner = ModelRunner(args, progress=False)
    ids = torch.randint(0, 256, (24,)).tolist()
    row = runner.req_to_token.alloc()
    runner.req_to_token.table[row, :24] = runner.allocator.alloc_extend(-1, 0, 24)
    ours = runner.forward([WorkItem(row, 0, ids, list(range(24)))]).logits
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3


# ---- other architectures, written as llama.cpp's converter writes them ----------------------------------------
_COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _tiny(arch: str):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Phi3Config

    if arch == "gemma3":  # llama.cpp's fixed pattern: five sliding layers, then a global one
        return Gemma3TextConfig(**_COMMON, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32,
                                sliding_window=12, max_position_embeddings=256,
                                layer_types=["sliding_attention"] * 5 + ["full_attention"])
    if arch == "gemma2":
        return Gemma2Config(**_COMMON, num_hidden_layers=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=12,
                            attn_logit_softcapping=5.0, final_logit_softcapping=3.0, max_position_embeddings=256)
    if arch == "phi3":
        return Phi3Config(**_COMMON, num_hidden_layers=2, max_position_embeddings=512,
                          original_max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                           "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                           "long_factor": [2.0 + 0.1 * i for i in range(8)]})
    return LlamaConfig(**_COMMON, num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64})


def _write_like_llama_cpp(path: str, arch: str, cfg, state: dict) -> None:
    """A GGUF as llama.cpp's convert_hf_to_gguf writes these architectures: its names, Gemma's norms as 1 + weight,
    Llama's Q/K rows permuted and llama3 rope scaling as a rope_freqs tensor, Phi-3's LongRoPE factors as tensors."""
    gemma = arch.startswith("gemma")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32("gemma2.final_logit_softcapping", cfg.final_logit_softcapping)
    if arch == "phi3":
        original = cfg.original_max_position_embeddings
        w.add_uint32("phi3.rope.scaling.original_context_length", original)
        scale = cfg.max_position_embeddings / original
        w.add_float32("phi3.rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if arch == "llama":  # the factors that turn plain inverse frequencies into llama3's
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, None)
        base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        w.add_tensor("rope_freqs.weight", (base / scaled.double()).float().numpy())
    names = _GEMMA_NAMES if gemma else {**_LAYER_NAMES, "post_attention_layernorm": "ffn_norm"}
    for name, t in state.items():
        arr = t.float().numpy()
        if name in HF_TO_GGUF:
            out = HF_TO_GGUF[name]
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            out = f"blk.{i}.{names[module]}.{kind}"
        if gemma and name.endswith("norm.weight"):
            arr = arr + 1
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = _permute(arr, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        w.add_tensor(out, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "phi3", "llama"])
def test_gguf_architectures_match_transformers(tmp_path, arch):
    """Gemma 3 (sliding layers and their own rotary base, q/k norms), Gemma 2 (soft caps), Phi-3 (fused qkv and
    gate/up, LongRoPE factors) and Llama 3 (llama3 rope scaling as rope_freqs, tied embeddings) from GGUF files
    laid out as llama.cpp's converter lays them out: the same logits as transformers' model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _tiny(arch)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    state = {k: v for k, v in hf.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    path = str(tmp_path / f"{arch}.gguf")
    _write_like_llama_cpp(path, arch, cfg, state)
    args = ServerArgs(model_path=path, dtype="float32", max_total_tokens=256, num_threads=THREADS,
                      skip_tokenizer_init=True).resolved()
    runner = ModelRunner(args, progress=False)
    ids = torch.randint(0, cfg.vocab_size, (40,)).tolist()
    row = runner.req_to_token.alloc()
    runner.req_to_token.table[row, :40] = runner.allocator.alloc_extend(-1, 0, 40)
    ours = runner.forward([WorkItem(row, 0, ids, list(range(40)))]).logits
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3, arch
