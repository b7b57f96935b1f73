"""The part of the server's configuration a model runner reads, taken from ServerArgs by field name
(`RunnerConfig.of`), so the executor never imports the whole server configuration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str | None
    tokenizer_path: str | None
    skip_tokenizer_init: bool
    dtype: str
    quantization: str
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

    @classmethod
    def of(cls, args) -> "RunnerConfig":
        """This config's fields taken from `args` (a ServerArgs or a RunnerConfig), which names them the same."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
