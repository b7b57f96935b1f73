"""What a program needs from a backend, and choice scoring shared by all of them."""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterable

from plait.lang.chat_template import ChatRoles

# (new text, meta_info of that piece): output logprobs are the piece's, counts are cumulative
OnDelta = Callable[[str, dict], None] | None
METHODS = ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized")


@dataclass(frozen=True)
class Call:
    """What a program sends with a model call besides the prompt and the sampling parameters."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool = False
    joins: tuple[str, ...] = ()  # KV joins (concate_and_append) whose KV the call may reuse
    lora: str | None = None  # the server's LoRA adapter the call runs with (None: the base model)

    def native_fields(self) -> dict:
        """The call's fields in a native /generate body (or Engine.generate keywords)."""
        out: dict = {"return_logprob": self.return_logprob, "top_logprobs_num": self.top_logprobs_num,
                     "return_text_in_logprobs": self.return_text_in_logprobs}
        if self.logprob_start_len is not None:
            out["logprob_start_len"] = self.logprob_start_len
        return {**out, **self.join_fields(), **self.lora_fields()}

    def lora_fields(self) -> dict:
        """`lora_path` for a native body or Engine.generate, when the call runs with an adapter."""
        return {"lora_path": self.lora} if self.lora else {}

    def join_fields(self) -> dict:
        """`kv_joins` for a native body or Engine.generate, when the call names any join."""
        return {"kv_joins": list(self.joins)} if self.joins else {}


def gather_stream(snapshots: Iterable[dict], on_delta: Callable[[str, dict], None], call: Call) -> tuple[str, dict]:
    """Feed a native stream's snapshots (cumulative text, each with its own output logprobs) to
    on_delta as pieces; returns the whole text and the last meta_info with all output logprobs."""
    text, meta, lps, tops = "", {}, [], []
    for snap in snapshots:
        delta = snap["text"][len(text):]
        text, meta = snap["text"], snap["meta_info"]
        lps += meta.get("output_token_logprobs") or []
        tops += meta.get("output_top_logprobs") or []
        on_delta(delta, meta)
    if call.return_logprob:
        meta = {**meta, "output_token_logprobs": lps, **({"output_top_logprobs": tops} if tops else {})}
    return text, meta


class TokenUsage:
    """Tokens a backend's calls used (SGLang's `backend.token_usage`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, meta: dict) -> None:
        with self._lock:
            self.prompt_tokens += int(meta.get("prompt_tokens") or 0)
            self.completion_tokens += int(meta.get("completion_tokens") or 0)

    def __repr__(self) -> str:
        return f"TokenUsage(prompt_tokens={self.prompt_tokens}, completion_tokens={self.completion_tokens})"


class Backend(ABC):
    is_chat_model = False  # True: the API takes messages, not a prompt to continue
    support_concate_and_append = False  # join_kv can reuse branches' KV

    @property
    def token_usage(self) -> TokenUsage:
        usage = self.__dict__.get("_token_usage")
        if usage is None:
            usage = self.__dict__.setdefault("_token_usage", TokenUsage())
        return usage

    @property
    def endpoint(self) -> "Backend":
        """SGLang's Runtime exposes its HTTP client as `.endpoint`; a plait backend is its own."""
        return self

    @abstractmethod
    def roles(self) -> ChatRoles:
        """Role markers from the model's chat template."""

    @abstractmethod
    def generate(self, prompt: str, messages: list[dict], params: dict, on_delta: OnDelta,
                 call: Call = Call()) -> tuple[str, dict]:
        """Continue `prompt`; returns (text, meta_info). With on_delta, text arrives there as it is made."""

    @abstractmethod
    def select(self, prompt: str, messages: list[dict], choices: list[str], method: str,
               temperature: float, call: Call = Call()) -> tuple[int, dict]:
        """Pick one of `choices` as the continuation of `prompt`; returns (index, meta_info)."""

    def embed(self, texts: list[str], model: str | None = None) -> list[list[float]]:
        """The texts' embeddings (L2-normalized), in order; `model`: the server's model that embeds."""
        raise NotImplementedError(f"{type(self).__name__} serves no embeddings")

    def cache_prefix(self, prompt: str, call: Call = Call()) -> None:
        """Compute `prompt` once so later requests that extend it hit the prefix cache."""

    def join_kv(self, fork_text: str, branch_texts: list[str], call: Call = Call()) -> dict | None:
        """Build the KV of fork_text + every branch text from the branches' own KV (concate_and_append).
        Returns {"join_id", ...} for later calls to name, or None where the backend cannot."""
        return None

    def get_model_name(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no model name")

    def get_server_info(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} has no server info")

    def flush_cache(self) -> bool:
        return False

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
