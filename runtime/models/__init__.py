"""Model implementations (runtime layout, weights from plait.runtime.model_loader), and the registry that
picks one by the checkpoint's architecture name."""

from __future__ import annotations

from torch import nn

from plait.runtime.model_config import ARCHITECTURES, ModelConfig
from plait.runtime.models.bert import BertModel
from plait.runtime.models.llama import LlamaForCausalLM

# config.json's `architectures[0]` -> the class that serves it; the dense and MoE Llama family share one decoder,
# BERT-style encoders (embeddings only) have their own
MODEL_REGISTRY: dict[str, type[nn.Module]] = {name: LlamaForCausalLM for name in ARCHITECTURES.values()}
MODEL_REGISTRY["BertModel"] = BertModel


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; supported: "
                         f"{sorted(MODEL_REGISTRY)}") from None


__all__ = ["BertModel", "LlamaForCausalLM", "MODEL_REGISTRY", "model_class"]
