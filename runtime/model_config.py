"""ModelConfig: the architecture facts the runtime needs, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> (qkv bias, per-head q/k RMSNorm)
LLAMA_FAMILY = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}


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
    qk_norm: bool
    context_length: int
    eos_token_ids: tuple[int, ...]
    hf_config: Any  # transformers PretrainedConfig (rope parameters, for the rope init functions)

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
            hf_config=hf,
        )
