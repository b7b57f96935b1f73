"""The part of the server's configuration speculation reads (the drafters and the scheduler's SpecManager)."""

from __future__ import annotations

from dataclasses import dataclass

from plait.runtime.narrow_config import NarrowConfig


@dataclass(frozen=True)
class DraftConfig(NarrowConfig):
    speculative_algorithm: str | None
    speculative_draft_model_path: str | None
    speculative_num_steps: int | None
    speculative_eagle_topk: int
    speculative_num_draft_tokens: int
    speculative_ngram_min_match_window_size: int
    speculative_ngram_max_match_window_size: int
    speculative_suffix_max_depth: int
    speculative_suffix_max_spec_factor: float
    speculative_suffix_min_token_prob: float
    speculative_suffix_max_cached_requests: int
    speculative_draft_vocab_size: int
    speculative_token_budget: int
    speculative_draft_policy: str  # how many tokens each request drafts (SpecManager)
    # how a draft model or a head's vocabulary layers load: as the target's do
    model_path: str | None
    quantization: str
    quantized_matmul: str
    disable_packed_weights: bool
    disable_native_decode: bool
    page_size: int
