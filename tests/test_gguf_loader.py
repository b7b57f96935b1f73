"""GGUF loading: a tiny Llama written as llama.cpp writes it (Q/K rows permuted, quantized blocks)
loads to the same logits as transformers on the same dequantized weights."""

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
    ours = runner.forward([WorkItem(row, 0, ids, list(range(24)))])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3
