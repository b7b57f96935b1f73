"""Model implementations (runtime layout, weights from plait.runtime.model_loader)."""

from plait.runtime.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
