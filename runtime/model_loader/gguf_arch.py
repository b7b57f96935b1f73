"""What llama.cpp's converter does to each architecture, undone: GGUF metadata -> ModelConfig, GGUF tensor
names -> HF names, and the layout changes (Q/K rows permuted for Llama's interleaved rotary, Gemma's norms
stored as 1 + weight, rotary factors stored as tensors)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from plait.runtime.model_config import ARCHITECTURES, FULL, LLAMA_FAMILY, SLIDING, ModelConfig, RopeSpec
from plait.runtime.model_loader.gguf_file import GGUFFile
from plait.runtime.model_loader.gguf_tokenizer import stop_token_ids

# GGUF general.architecture -> the transformers model_type it was converted from (MoE GGUF is not served)
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
               "gemma3": "gemma3_text", "phi3": "phi3"}
# llama.cpp's converter permutes Q/K rows (interleaved rotary) for these architectures only
_PERMUTED = {"llama", "mistral"}
_GEMMA = {"gemma2", "gemma3"}

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma: a norm after attention, and the MLP's own pre- and post-norm (HF's post_attention_layernorm is the
# former there, where Llama's is the MLP's pre-norm)
_GEMMA_LAYER = {**_LAYER, "post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Phi-3: ffn_up holds gate and up as one tensor (HF's gate_up_proj)
_PHI3_LAYER = {**_LAYER, "ffn_up.weight": "mlp.gate_up_proj.weight"}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# tensors that are rotary parameters, not weights: read into the config
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(arch: str, name: str) -> str:
    """The HF name of a GGUF tensor (unknown names pass through: the strict loader reports them)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".", 2)
    table = _GEMMA_LAYER if arch in _GEMMA else _PHI3_LAYER if arch == "phi3" else _LAYER
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in table:
        return f"model.layers.{parts[1]}.{table[parts[2]]}"
    return name


def needs_unpermute(arch: str, name: str) -> bool:
    return arch in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight"))


def unpermute_qk(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's rotary row permutation (rows interleaved per head) back to HF layout (rows, blocks or
    floats: only whole rows move)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def norm_shift(arch: str, name: str) -> float:
    """What to add to a float tensor to put it in HF layout: Gemma's GGUF norms hold 1 + the HF weight."""
    return -1.0 if arch in _GEMMA and name.endswith("norm.weight") else 0.0


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """From GGUF metadata directly: building a transformers config would import ~2 s of modules."""
    arch = f.architecture
    if arch not in MODEL_TYPES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(MODEL_TYPES)}")
    mt = MODEL_TYPES[arch]
    get = f.arch_key
    names = {t.name for t in f.tensors}
    qkv_bias, qk_norm = LLAMA_FAMILY[mt]
    hidden, heads, layers = int(get("embedding_length")), int(get("attention.head_count")), int(get("block_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    if int(get("rope.dimension_count") or head_dim) != head_dim:
        raise ValueError(f"partial rotary embeddings ({get('rope.dimension_count')} of {head_dim} dimensions) are "
                         "not supported")
    vocab = get("vocab_size") or len(f.metadata.get("tokenizer.ggml.tokens") or [])
    window = get("attention.sliding_window")
    layer_types = _layer_types(arch, layers, window)
    gemma = arch in _GEMMA
    ff = get("feed_forward_length")
    return ModelConfig(
        model_type=mt,
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv") or heads),
        head_dim=head_dim,
        intermediate_size=int(ff[0] if isinstance(ff, np.ndarray) else ff),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=qkv_bias or "blk.0.attn_q.bias" in names,
        qk_norm=qk_norm if "blk.0.attn_q_norm.weight" in names else None,
        context_length=int(get("context_length", 4096)),
        eos_token_ids=stop_token_ids(f.metadata),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        architecture=ARCHITECTURES[mt],
        rope=_rope(f, names),
        rope_local=RopeSpec(10000.0) if arch == "gemma3" else None,  # llama.cpp's fixed local base
        hidden_act="gelu_tanh" if gemma else "silu",
        sandwich_norms=gemma,
        norm_offset=1.0 if gemma else 0.0,
        embed_scale=float(hidden) ** 0.5 if gemma else 1.0,
        attn_scale=_gemma_attn_scale(arch, hidden, heads, head_dim, layers) if gemma else None,
        attn_softcap=_positive(get("attn_logit_softcapping")) if gemma else None,
        final_softcap=_positive(get("final_logit_softcapping")) if gemma else None,
        layer_types=layer_types,
        sliding_window=int(window) if layer_types else None,
        fused_qkv="blk.0.attn_qkv.weight" in names,
        fused_gate_up=arch == "phi3" and "blk.0.ffn_gate.weight" not in names,
    )


def _positive(x: Any) -> float | None:
    return float(x) if x else None


def _layer_types(arch: str, layers: int, window: Any) -> tuple[str, ...]:
    """Which layers slide: llama.cpp's fixed patterns (GGUF stores only the window)."""
    if not window:
        return ()
    if arch == "gemma3":  # five sliding layers, then a global one
        return tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers))
    if arch == "gemma2":  # alternating, the first sliding
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(layers))
    return (SLIDING,) * layers  # Mistral, Phi-3: every layer


def _gemma_attn_scale(arch: str, hidden: int, heads: int, head_dim: int, layers: int) -> float:
    """query_pre_attn_scalar ** -0.5, which GGUF does not store: hidden / heads for the 27B models (46 and 62
    layers), the head size otherwise (llama.cpp's rule)."""
    big = (arch == "gemma2" and layers == 46) or (arch == "gemma3" and layers == 62)
    return float(hidden // heads if big else head_dim) ** -0.5


def _rope(f: GGUFFile, names: set[str]) -> RopeSpec:
    """The full-attention layers' rotary embedding: scaling from the metadata, factors from rope tensors."""
    theta, get = float(f.arch_key("rope.freq_base", 10000.0)), f.arch_key
    kind = get("rope.scaling.type") or "none"
    if "rope_factors_long.weight" in names:  # Phi-3 LongRoPE
        original = int(get("rope.scaling.original_context_length") or get("context_length"))
        attention = get("rope.scaling.attn_factor")
        if attention is None:
            factor = int(get("context_length")) / original
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        return RopeSpec(theta, "longrope", short_factors=_tensor_values(f, "rope_factors_short.weight"),
                        long_factors=_tensor_values(f, "rope_factors_long.weight"), original_max=original,
                        attention_factor=float(attention))
    factors = _tensor_values(f, "rope_freqs.weight") if "rope_freqs.weight" in names else ()
    if kind == "linear":
        return RopeSpec(theta, "linear", factor=float(get("rope.scaling.factor")), freq_factors=factors)
    if kind not in ("none", "llama3") and kind:
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported; load the HF folder instead")
    return RopeSpec(theta, freq_factors=factors)


def _tensor_values(f: GGUFFile, name: str) -> tuple[float, ...]:
    (info,) = [t for t in f.tensors if t.name == name]
    if info.ggml_type != 0:
        raise ValueError(f"rotary tensor {name} is {info.type_name}, expected F32")
    return tuple(float(x) for x in np.frombuffer(f.data(info), dtype=np.float32))
