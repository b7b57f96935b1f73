"""SamplingParams: SGLang's sampling_params, validated (unknown keys and bad values name the field)."""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from plait.runtime.constrained.base import JSON_KEY_ORDER, JSON_WHITESPACE

INT64_MAX = 2**63 - 1
GREEDY_TEMPERATURE = 1e-5
# a smaller penalty divides logits past float32 (1e-300 is 0 there): the sampler would see inf
MIN_REPETITION_PENALTY = 1e-6


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    # at most one grammar constraint (compiled by the scheduler's grammar backend)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # the layout of a json_schema output (constrained/base.JsonStyle); None: the server's flags
    json_whitespace: str | None = None
    json_key_order: str | None = None
    # SGLang's keys that plait accepts but cannot honour: null or default only (the sglang
    # frontend always sends them), anything else is refused rather than silently ignored
    n: int = 1
    stop_regex: str | list[str] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Build and validate; raises ValueError naming the offending key."""
        d = dict(d or {})
        known = set(cls.__struct_fields__)
        for key in d:
            if key not in known:
                raise ValueError(f"unknown sampling_params key {key!r}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if isinstance(d.get("json_schema"), dict):  # SGLang wants a string; an object is unambiguous
            d["json_schema"] = json.dumps(d["json_schema"])
        d = {k: v for k, v in d.items() if v is not None or k == "seed"}
        try:  # strict: no bool for an int, no string for a number (an int for a float is fine)
            params = msgspec.convert(d, cls, strict=True)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid sampling_params: {e}") from None
        params.validate()
        return params

    def validate(self) -> None:
        def bad(field: str, why: str) -> None:
            raise ValueError(f"sampling_params.{field} {why}, got {getattr(self, field)!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(name, "must be a finite number")
        if not 0 <= self.max_new_tokens <= INT64_MAX:
            bad("max_new_tokens", f"must be in [0, {INT64_MAX}]")
        if not 0 <= self.min_new_tokens <= INT64_MAX:
            bad("min_new_tokens", f"must be in [0, {INT64_MAX}]")
        if self.seed is not None and not 0 <= self.seed <= INT64_MAX:
            bad("seed", f"must be in [0, {INT64_MAX}]")
        if self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", f"must be <= max_new_tokens ({self.max_new_tokens})")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1 or self.top_k > INT64_MAX:
            bad("top_k", "must be -1 (off) or >= 1 (values above the vocabulary size mean all of it)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2:
            bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if any(not s for s in self.stop):
            bad("stop", "must not contain empty strings")
        if any(not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")
        if self.n != 1:
            bad("n", "must be 1 (send a batch, or use the OpenAI API's n)")
        given = [k for k in ("regex", "json_schema", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"sampling_params: give at most one of regex, json_schema, ebnf; got {given}")
        if self.stop_regex:
            bad("stop_regex", "is not supported")
        if self.json_whitespace is not None and self.json_whitespace not in JSON_WHITESPACE:
            bad("json_whitespace", f"must be one of {list(JSON_WHITESPACE)}")
        if self.json_key_order is not None and self.json_key_order not in JSON_KEY_ORDER:
            bad("json_key_order", f"must be one of {list(JSON_KEY_ORDER)}")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the constraint, if any."""
        for kind in ("json_schema", "regex", "ebnf"):
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None

    @property
    def is_greedy(self) -> bool:
        # below this, logits / temperature overflows: the limit of sampling is the argmax anyway
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
