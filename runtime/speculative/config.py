"""The part of the server's configuration a drafter reads, built from ServerArgs by field name (`DraftConfig.of`),
so speculation never imports the whole server configuration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftConfig:
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
    # how a draft model or a head's vocabulary layers load: as the target's do
    model_path: str | None
    quantization: str
    disable_packed_weights: bool
    disable_native_decode: bool
    page_size: int

    @classmethod
    def of(cls, args) -> "DraftConfig":
        """The fields of this config taken from `args` (a ServerArgs), which names them the same."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
