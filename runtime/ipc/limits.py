"""What a request must fit, known to the scheduler and sent to clients at start-up, so bad
requests are refused before they cross a process boundary."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from plait.runtime.ipc.messages import TokenizedGenerateReq
from plait.runtime.model_config import POOLINGS
from plait.runtime.sampling.params import INT64_MAX

MAX_TOP_LOGPROBS = 20  # the hard ceiling; --max-top-logprobs may set a lower one
MAX_JSON_DEPTH = 64
MAX_KV_JOINS = 64  # join ids one request may name
MAX_JOIN_ID_CHARS = 64


class RuntimeLimits(msgspec.Struct, frozen=True):
    context_length: int
    kv_capacity: int
    vocab_size: int
    weight_bytes: int = 0
    embedding_dim: int = 0  # an embedding's length (the model's hidden size)
    generates: bool = True  # False: an encoder, which computes embeddings only
    matryoshka: bool = False  # an embedding's leading dimensions are one too (OpenAI's `dimensions`)


def validate_request(msg: TokenizedGenerateReq, limits: RuntimeLimits) -> None:
    """Raise ValueError for a request that can never run."""
    n = len(msg.input_ids)
    if n == 0:
        raise ValueError("the prompt is empty (input_ids must not be empty)")
    if msg.embed is not None:
        _check_embed(msg, limits)
    elif not limits.generates:
        raise ValueError("this model computes embeddings only (/v1/embeddings, /encode, /api/embed): it cannot "
                         "generate text")
    elif n >= limits.context_length:
        raise ValueError(f"the prompt has {n} tokens, which does not fit the context length {limits.context_length}")
    if n + 1 > limits.kv_capacity:
        raise ValueError(f"the prompt has {n} tokens, which does not fit the KV pool ({limits.kv_capacity} tokens)")
    if any(t < 0 or t >= limits.vocab_size for t in msg.input_ids):
        raise ValueError(f"input_ids must be in [0, {limits.vocab_size})")
    p = msg.sampling_params
    if any(t >= limits.vocab_size for t in p.stop_token_ids):
        raise ValueError(f"sampling_params.stop_token_ids must be in [0, {limits.vocab_size})")
    if p.max_new_tokens > limits.context_length - n:  # checked before admission, as chat and completions do
        raise ValueError(f"sampling_params.max_new_tokens {p.max_new_tokens} plus the prompt's {n} tokens exceeds "
                         f"the context length {limits.context_length}")
    if p.min_new_tokens > limits.context_length - n:
        raise ValueError(f"sampling_params.min_new_tokens {p.min_new_tokens} plus the prompt's {n} tokens exceeds "
                         f"the context length {limits.context_length}")
    if not 0 <= msg.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]")
    if not -1 <= msg.logprob_start_len <= INT64_MAX:
        raise ValueError("logprob_start_len must be >= -1 and fit in 64 bits")
    check_kv_joins(msg.kv_joins)
    if msg.lora is not None and (not isinstance(msg.lora, str) or not msg.lora or msg.kv_joins):
        raise ValueError("lora_path must name a loaded LoRA adapter (and KV joins take no adapter)")


def _check_embed(msg: TokenizedGenerateReq, limits: RuntimeLimits) -> None:
    n = len(msg.input_ids)
    if n > limits.context_length:
        raise ValueError(f"the input has {n} tokens, more than the model's context length of {limits.context_length}")
    if msg.embed.pooling and msg.embed.pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {msg.embed.pooling!r}")
    if not limits.generates and msg.embed.pooling == "last":
        raise ValueError("last-token pooling needs a decoder model: an encoder's tokens each see all the others")
    if msg.sampling_params.max_new_tokens != 0 or msg.return_logprob or msg.kv_joins:
        raise ValueError("an embedding request generates nothing: max_new_tokens 0, no logprobs, no KV joins")


def check_kv_joins(kv_joins: Any) -> list[str]:
    """kv_joins: join ids from /join_kv (or Engine.join_kv) whose KV a request may reuse."""
    if kv_joins is None:
        return []
    if (not isinstance(kv_joins, list) or len(kv_joins) > MAX_KV_JOINS
            or not all(isinstance(j, str) and 0 < len(j) <= MAX_JOIN_ID_CHARS for j in kv_joins)):
        raise ValueError(f"kv_joins must be a list of at most {MAX_KV_JOINS} join ids (non-empty strings of "
                         f"at most {MAX_JOIN_ID_CHARS} characters)")
    return list(kv_joins)


def check_request_work(msgs: list[TokenizedGenerateReq], args, limits: RuntimeLimits) -> None:
    """Refuse a request asking for more work than the server's per-request limits allow
    (ServerArgs.max_*); each refusal names the flag. Tokens count up to the context length."""
    if len(msgs) > args.max_sequences_per_request:
        raise ValueError(f"the request starts {len(msgs)} sequences (prompts x n); the limit is "
                         f"{args.max_sequences_per_request} (--max-sequences-per-request)")
    total = sum(min(m.sampling_params.max_new_tokens, limits.context_length - len(m.input_ids)) for m in msgs)
    if total > args.max_new_tokens_per_request:
        raise ValueError(f"the request asks for {total} new tokens over its {len(msgs)} sequences; the limit is "
                         f"{args.max_new_tokens_per_request} (--max-new-tokens-per-request)")
    for m in msgs:
        stop = m.sampling_params.stop
        if len(stop) > args.max_stop_strings:
            raise ValueError(f"sampling_params.stop has {len(stop)} strings; the limit is {args.max_stop_strings} "
                             "(--max-stop-strings)")
        if any(len(s) > args.max_stop_string_length for s in stop):
            raise ValueError(f"sampling_params.stop has a string longer than {args.max_stop_string_length} "
                             "characters (--max-stop-string-length)")
        if m.top_logprobs_num > args.max_top_logprobs:
            raise ValueError(f"top_logprobs_num {m.top_logprobs_num} exceeds the limit of {args.max_top_logprobs} "
                             "(--max-top-logprobs)")


def check_json_value(value: Any, where: str = "") -> None:
    """Refuse values JSON parsers accept but nothing downstream can handle: NaN/Infinity (Python's
    json reads them, and 1e999 becomes inf), ints beyond int64, lone surrogates (valid JSON escapes,
    invalid text), nesting beyond MAX_JSON_DEPTH. Iterative, so depth cannot overflow the stack."""
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, (dict, list)) and depth >= MAX_JSON_DEPTH:
            raise ValueError(f"the body is nested too deeply (more than {MAX_JSON_DEPTH} levels) at {path or 'the top'}")
        if isinstance(v, dict):
            for k, item in v.items():
                _check_text(k, f"{path}.{k!r}" if path else repr(k))
                stack.append((item, f"{path}.{k}" if path else str(k), depth + 1))
        elif isinstance(v, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(v))
        elif isinstance(v, str):
            _check_text(v, path)
        elif isinstance(v, bool) or v is None:
            pass
        elif isinstance(v, int):
            if not -INT64_MAX - 1 <= v <= INT64_MAX:
                raise ValueError(f"{path} is out of range (integers must fit in 64 bits)")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{path} must be a finite number, got {v}")


def _check_text(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{path} is not valid text: a lone UTF-16 surrogate at character {e.start}") from None
