"""The part of the server's configuration a model runner reads."""

from __future__ import annotations

from dataclasses import dataclass

from plait.runtime.narrow_config import NarrowConfig


@dataclass(frozen=True)
class RunnerConfig(NarrowConfig):
    model_path: str | None
    tokenizer_path: str | None
    skip_tokenizer_init: bool
    dtype: str
    quantization: str
    quantized_matmul: str
    disable_packed_weights: bool
    disable_native_decode: bool
    enable_deterministic_inference: bool
    context_length: int | None
    # KV memory and batch shape
    kv_cache_dtype: str
    page_size: int
    mem_fraction_static: float
    max_total_tokens: int | None
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int
    swa_full_tokens_ratio: float
    disable_hybrid_swa_memory: bool
    # threads
    num_threads: int
    thread_policy: str
    # LoRA adapters
    lora_paths: tuple[str, ...]
    lora_memory_mb: int
