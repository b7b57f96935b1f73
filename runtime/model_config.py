"""ModelConfig: the architecture facts the runtime needs, read from a transformers config."""

from __future__ import annotations

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
}
ARCHITECTURES = {  # model_type -> the transformers class name (the registry's key)
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
DENSE_GGUF = ("llama", "mistral", "qwen2", "qwen3")  # GGUF architectures served (MoE GGUF is not)


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

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        mt = hf.model_type
        if mt not in LLAMA_FAMILY:
            raise ValueError(f"unsupported model_type {mt!r}; supported: {sorted(LLAMA_FAMILY)}")
        qkv_bias, qk_norm = LLAMA_FAMILY[mt]
        qkv_bias = qkv_bias or bool(getattr(hf, "attention_bias", False))
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope = getattr(hf, "rope_parameters", None) or {}
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
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
            hf_config=hf,
            moe=MoEConfig.from_hf(hf),
            architecture=(getattr(hf, "architectures", None) or [ARCHITECTURES[mt]])[0],
            clip_qkv=getattr(hf, "clip_qkv", None),
        )

    @classmethod
    def from_gguf(cls, metadata: dict, tensor_names: tuple[str, ...]) -> "ModelConfig":
        """From GGUF metadata directly: building a transformers config would import ~2 s of modules."""
        arch = metadata["general.architecture"]
        if arch not in DENSE_GGUF:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(DENSE_GGUF)}")
        if metadata.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
            raise ValueError(f"GGUF rope scaling {metadata[f'{arch}.rope.scaling.type']!r} is not supported; "
                             "load the HF folder instead")

        def get(key: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{key}", default)

        qkv_bias, qk_norm = LLAMA_FAMILY[arch]
        hidden, heads = get("embedding_length"), get("attention.head_count")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            model_type=arch,
            vocab_size=get("vocab_size") or metadata["tokenizer.ggml.tokens"],
            hidden_size=hidden,
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv") or heads,
            head_dim=get("attention.key_length") or hidden // heads,
            intermediate_size=get("feed_forward_length"),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias=qkv_bias or "blk.0.attn_q.bias" in tensor_names,
            qk_norm=qk_norm,
            context_length=get("context_length", 4096),
            eos_token_ids=(eos,) if eos is not None else (),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            architecture=ARCHITECTURES[arch],
        )
