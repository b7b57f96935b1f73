"""What a request must fit, known to the scheduler and sent to clients at start-up, so bad
requests are refused before they cross a process boundary."""

from __future__ import annotations

import msgspec

from plait.runtime.io_struct import TokenizedGenerateReq

MAX_TOP_LOGPROBS = 20


class RuntimeLimits(msgspec.Struct, frozen=True):
    context_length: int
    kv_capacity: int
    vocab_size: int
    weight_bytes: int = 0


def validate_request(msg: TokenizedGenerateReq, limits: RuntimeLimits) -> None:
    """Raise ValueError for a request that can never run."""
    n = len(msg.input_ids)
    if n == 0:
        raise ValueError("the prompt is empty (input_ids must not be empty)")
    if n >= limits.context_length:
        raise ValueError(f"the prompt has {n} tokens, which does not fit the context length {limits.context_length}")
    if n + 1 > limits.kv_capacity:
        raise ValueError(f"the prompt has {n} tokens, which does not fit the KV pool ({limits.kv_capacity} tokens)")
    if any(t < 0 or t >= limits.vocab_size for t in msg.input_ids):
        raise ValueError(f"input_ids must be in [0, {limits.vocab_size})")
    if not 0 <= msg.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]")
    if msg.logprob_start_len < -1:
        raise ValueError("logprob_start_len must be >= -1")
