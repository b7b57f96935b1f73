"""ModelConfig: the architecture facts the runtime needs, read from a transformers config (or, for a GGUF
file, from its metadata: runtime/model_loader/gguf_arch.py).

One decoder serves every family (runtime/models/llama.py); what differs is a switch here: qkv bias,
q/k norms, the MLP's activation, Gemma's norms around both sublayers and its embedding scale, sliding-
window layers and their own rotary base, soft-capped attention scores and logits, fused checkpoint
projections (Phi-3), rotary scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# model_type -> (qkv bias, q/k RMSNorm: None, "head" (per head, Qwen3) or "full" (over all heads, OLMoE))
LLAMA_FAMILY = {
    "llama": (False, None),
    "mistral": (False, None),
    "qwen2": (True, None),
    "qwen3": (False, "head"),
    "mixtral": (False, None),
    "qwen2_moe": (True, None),
    "qwen3_moe": (False, "head"),
    "olmoe": (False, "full"),
    "gemma2": (False, None),
    "gemma3_text": (False, "head"),
    "phi3": (False, None),
}
ARCHITECTURES = {  # model_type -> the transformers class name (the registry's key)
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
GEMMA = ("gemma2", "gemma3_text")
# encoder-only models (bidirectional attention, absolute positions): served for embeddings only
ENCODERS = {"bert": "BertModel"}
POOLINGS = ("last", "mean", "cls")  # how an embedding is pooled from the final hidden states
FULL, SLIDING = "full_attention", "sliding_attention"  # layer types (transformers' names)


@dataclass(frozen=True)
class RopeSpec:
    """One rotary embedding. `rope_type`:
      default   inv_freq = theta^(-2i/d), divided element-wise by `freq_factors` where given (GGUF
                rope_freqs: llama3-style scaling written out by llama.cpp)
      linear    positions divided by `factor` (inv_freq / factor)
      longrope  Phi-3: inv_freq divided by `short_factors` below `original_max` positions and by
                `long_factors` from there on; cos and sin scaled by `attention_factor`
      hf        transformers' own init function for the config's rope_parameters (llama3, yarn, dynamic, ...),
                of `layer_type` where the parameters are per layer type (Gemma 3)
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    freq_factors: tuple[float, ...] = ()
    short_factors: tuple[float, ...] = ()
    long_factors: tuple[float, ...] = ()
    original_max: int = 0
    attention_factor: float = 1.0
    layer_type: str | None = None


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a MoE model."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's width
    renormalize: bool  # the top-k weights rescaled to sum to one
    shared_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert, scaled by a sigmoid gate
    sparse_layers: tuple[int, ...] = ()  # layers with the sparse MLP (the rest are dense)
    router_prefix: str = "mlp"  # checkpoint names: {layer}.{prefix}.gate, {prefix}.experts.{e}.{name}
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2

    @classmethod
    def from_hf(cls, hf: Any) -> "MoEConfig | None":
        mt, layers = hf.model_type, hf.num_hidden_layers
        if mt == "mixtral":
            return cls(hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size, True,
                       sparse_layers=tuple(range(layers)), router_prefix="block_sparse_moe",
                       expert_names=("w1", "w3", "w2"))
        if mt == "olmoe":
            return cls(hf.num_experts, hf.num_experts_per_tok, hf.intermediate_size, bool(hf.norm_topk_prob),
                       sparse_layers=tuple(range(layers)))
        if mt in ("qwen2_moe", "qwen3_moe"):
            step, dense = getattr(hf, "decoder_sparse_step", 1) or 1, set(getattr(hf, "mlp_only_layers", []) or [])
            sparse = tuple(i for i in range(layers) if i not in dense and hf.num_experts > 0 and (i + 1) % step == 0)
            shared = getattr(hf, "shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else 0
            return cls(hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, bool(hf.norm_topk_prob),
                       shared_intermediate_size=shared or 0, sparse_layers=sparse)
        return None


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: str | None
    context_length: int
    eos_token_ids: tuple[int, ...]
    rope_theta: float
    hf_config: Any = None  # transformers config where there is one (scaled-rope variants read it)
    moe: MoEConfig | None = None  # the sparse MLP of MoE models
    architecture: str = "LlamaForCausalLM"  # the class name in the checkpoint's config (the model registry's key)
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to +-clip_qkv
    rope: RopeSpec | None = None  # the (full-attention) layers' rotary embedding; None: default at rope_theta
    rope_local: RopeSpec | None = None  # sliding-window layers' own rotary embedding (Gemma 3), else None
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_tanh (Gemma's GeGLU)
    sandwich_norms: bool = False  # Gemma 2/3: a norm after attention and one before and after the MLP
    norm_offset: float = 0.0  # RMS norms scale by norm_offset + weight (Gemma stores weight - 1)
    embed_scale: float = 1.0  # token embeddings multiplied by this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # attention score scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores soft-capped to +-cap (cap * tanh(s / cap))
    final_softcap: float | None = None  # Gemma 2: logits soft-capped likewise
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; () means all FULL
    sliding_window: int | None = None  # keys a SLIDING layer's query sees, its own included
    fused_qkv: bool = False  # the checkpoint holds q, k and v as one qkv_proj (Phi-3)
    fused_gate_up: bool = False  # and gate and up as one gate_up_proj
    causal: bool = True  # False: an encoder (runtime/models/bert.py), whose requests are embeddings only
    pooling: str = "last"  # an embedding's default pooling (POOLINGS): a decoder's last token; an encoder's own
    matryoshka: bool = False  # trained so that an embedding's leading dimensions are one too (`dimensions`)

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL

    @property
    def has_sliding_window(self) -> bool:
        return self.sliding_window is not None and SLIDING in self.layer_types

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        mt = hf.model_type
        if mt in ENCODERS:
            return cls._encoder(hf)
        if mt not in LLAMA_FAMILY:
            raise ValueError(f"unsupported model_type {mt!r}; supported: {sorted([*LLAMA_FAMILY, *ENCODERS])}")
        qkv_bias, qk_norm = LLAMA_FAMILY[mt]
        qkv_bias = qkv_bias or bool(getattr(hf, "attention_bias", False))
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        if float(getattr(hf, "partial_rotary_factor", None) or 1.0) != 1.0:
            raise ValueError(f"partial rotary embeddings (partial_rotary_factor {hf.partial_rotary_factor}) are not "
                             "supported")
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope = getattr(hf, "rope_parameters", None) or {}
        per_type = FULL in rope  # Gemma 3: one set of rope parameters per layer type
        theta = float((rope[FULL] if per_type else rope).get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) is not False else None
        layer_types = tuple(getattr(hf, "layer_types", None) or ())
        if window and not layer_types:  # Mistral, Phi-3: every layer slides
            layer_types = (SLIDING,) * hf.num_hidden_layers
        if not window or SLIDING not in layer_types:
            window, layer_types = None, ()
        gemma = mt in GEMMA
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            context_length=getattr(hf, "max_position_embeddings", 4096),
            eos_token_ids=eos_ids,
            rope_theta=theta,
            hf_config=hf,
            moe=MoEConfig.from_hf(hf),
            architecture=(getattr(hf, "architectures", None) or [ARCHITECTURES[mt]])[0],
            clip_qkv=getattr(hf, "clip_qkv", None),
            rope=_hf_rope(hf, rope[FULL] if per_type else rope, FULL if per_type else None, theta),
            rope_local=_hf_rope(hf, rope[SLIDING], SLIDING, theta) if per_type and SLIDING in rope else None,
            hidden_act="gelu_tanh" if gemma else "silu",
            sandwich_norms=gemma,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=float(hf.hidden_size) ** 0.5 if gemma else 1.0,
            attn_scale=float(hf.query_pre_attn_scalar) ** -0.5 if gemma else None,
            attn_softcap=getattr(hf, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(hf, "final_logit_softcapping", None) if gemma else None,
            layer_types=layer_types,
            sliding_window=window,
            fused_qkv=mt == "phi3",
            fused_gate_up=mt == "phi3",
        )

    @classmethod
    def _encoder(cls, hf: Any) -> "ModelConfig":
        """A BERT-style encoder: the fields the runtime reads (layers, heads, context), with mean pooling unless
        the folder says otherwise (sources.HFSource reads sentence-transformers' pooling config)."""
        if getattr(hf, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {hf.position_embedding_type!r} is not supported (absolute)")
        heads = hf.num_attention_heads
        return cls(
            model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers, num_heads=heads, num_kv_heads=heads, head_dim=hf.hidden_size // heads,
            intermediate_size=hf.intermediate_size, rms_norm_eps=hf.layer_norm_eps, tie_word_embeddings=False,
            qkv_bias=True, qk_norm=None, context_length=hf.max_position_embeddings, eos_token_ids=(),
            rope_theta=0.0, hf_config=hf, architecture=ENCODERS[hf.model_type], hidden_act=hf.hidden_act,
            causal=False, pooling="mean",
            matryoshka=bool(getattr(hf, "matryoshka_dimensions", None) or getattr(hf, "is_matryoshka", False)))


def _hf_rope(hf: Any, params: dict, layer_type: str | None, theta: float) -> RopeSpec:
    """The RopeSpec of a transformers config's rope parameters (of one layer type, for Gemma 3)."""
    rope_type = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", theta))
    if rope_type == "default":
        return RopeSpec(theta)
    if rope_type == "linear":
        return RopeSpec(theta, "linear", factor=float(params["factor"]))
    if rope_type == "longrope":
        original = int(params.get("original_max_position_embeddings")
                       or getattr(hf, "original_max_position_embeddings", 0) or hf.max_position_embeddings)
        factor = params.get("factor") or hf.max_position_embeddings / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        return RopeSpec(theta, "longrope", short_factors=tuple(params["short_factor"]),
                        long_factors=tuple(params["long_factor"]), original_max=original,
                        attention_factor=float(attention))
    return RopeSpec(theta, "hf", layer_type=layer_type)
