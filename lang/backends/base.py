"""What a program needs from a backend, and choice scoring shared by all of them."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Callable

from plait.lang.chat_template import ChatRoles

OnDelta = Callable[[str], None] | None
METHODS = ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized")


class Backend(ABC):
    @abstractmethod
    def roles(self) -> ChatRoles:
        """Role markers from the model's chat template."""

    @abstractmethod
    def generate(self, prompt: str, messages: list[dict], params: dict, on_delta: OnDelta,
                 return_logprob: bool = False, top_logprobs_num: int = 0) -> tuple[str, dict]:
        """Continue `prompt`; returns (text, meta_info). With on_delta, text arrives there as it is made."""

    @abstractmethod
    def select(self, prompt: str, messages: list[dict], choices: list[str], method: str,
               temperature: float) -> tuple[int, dict]:
        """Pick one of `choices` as the continuation of `prompt`; returns (index, meta_info)."""

    def cache_prefix(self, prompt: str) -> None:
        """Compute `prompt` once so later requests that extend it hit the prefix cache."""

    def shutdown(self) -> None:
        pass


def unconditional_context(prompt: str) -> str:
    """What unconditional_likelihood_normalized scores the choices after: a bare newline plus the
    prompt's trailing whitespace (so a choice tokenizes as it does after the prompt)."""
    return "\n" + prompt[len(prompt.rstrip()):]


def choose(method: str, logprobs: list[list[float]], unconditional: list[list[float]] | None = None
           ) -> tuple[int, dict]:
    """Score choices from their tokens' logprobs (one list per choice)."""
    if method not in METHODS:
        raise ValueError(f"choices_method must be one of {list(METHODS)}, got {method!r}")
    normalized = [sum(lps) / max(len(lps), 1) for lps in logprobs]
    meta: dict = {"normalized_prompt_logprobs": normalized, "input_token_logprobs": logprobs}
    if method == "token_length_normalized":
        scores = normalized
    elif method == "unconditional_likelihood_normalized":
        assert unconditional is not None
        # mean logprob in context minus mean logprob without it (token counts may differ)
        scores = [n - sum(un) / max(len(un), 1) for n, un in zip(normalized, unconditional)]
        meta["unconditional_token_logprobs"] = unconditional
    else:  # greedy: best first token, ties broken by the next token, and so on
        alive = list(range(len(logprobs)))
        pos = 0
        while len(alive) > 1 and any(pos < len(logprobs[i]) for i in alive):
            vals = {i: logprobs[i][pos] if pos < len(logprobs[i]) else -math.inf for i in alive}
            best = max(vals.values())
            alive = [i for i in alive if vals[i] >= best - 1e-9]
            pos += 1
        scores = [0.0 if i == alive[0] else -1.0 for i in range(len(logprobs))]
    index = max(range(len(scores)), key=lambda i: scores[i])
    meta["scores"] = scores
    return index, meta
