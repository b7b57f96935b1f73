"""A request on the client side: the validated input of one /generate call (a single request or a batch),
what the client knows of each request while it runs (ReqState), and the errors a caller may get."""

from __future__ import annotations

import asyncio
import time
import uuid

from plait.runtime.ipc.limits import check_json_value, check_kv_joins
from plait.runtime.ipc.messages import FinishReason, StrOut, TokenizedGenerateReq
from plait.runtime.sampling import SamplingParams


class RuntimeDead(RuntimeError):
    """A runtime process died; nothing more can run."""


class QueueFull(RuntimeError):
    """More requests are waiting than --max-queued-requests allows."""


class RequestFailed(RuntimeError):
    """The runtime ended the request with an error of its own: a bug met while serving it (500) or
    a shutdown (503). Other requests are unaffected."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class GenerateInput:
    """One /generate call, validated: a single request or a batch, in input order."""

    def __init__(self, text: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
                 sampling_params: dict | list[dict] | None = None, return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | list[int] = -1, top_logprobs_num: int | list[int] = 0,
                 return_text_in_logprobs: bool = False, stream: bool = False, rid: str | list[str] | None = None,
                 kv_joins: list[str] | None = None, lora_path: str | list[str | None] | None = None):
        check_json_value({"text": text, "rid": rid, "sampling_params": sampling_params})  # also for Engine callers
        if (text is None) == (input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if text is not None:
            self.single = isinstance(text, str)
            texts = [text] if self.single else text
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("text must be a string or a non-empty list of strings")
            self.texts: list[str] | None = texts
            self.ids: list[list[int]] | None = None
            n = len(texts)
        else:
            if not isinstance(input_ids, list):
                raise ValueError("input_ids must be a list of ints or a list of lists of ints")
            self.single = not input_ids or not isinstance(input_ids[0], list)
            ids = [input_ids] if self.single else input_ids
            if not all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
                       for x in ids) or not ids:
                raise ValueError("input_ids must be a list of ints or a non-empty list of lists of ints")
            self.texts, self.ids = None, ids
            n = len(ids)
        self.n = n
        self.params = [SamplingParams.from_dict(p) for p in _per_item(sampling_params, n, "sampling_params", dict)]
        self.return_logprob = _per_item(return_logprob, n, "return_logprob", bool)
        self.logprob_start_len = _per_item(logprob_start_len, n, "logprob_start_len", int)
        self.top_logprobs_num = _per_item(top_logprobs_num, n, "top_logprobs_num", int)
        self.return_text_in_logprobs = _flag(return_text_in_logprobs, "return_text_in_logprobs")
        self.stream = _flag(stream, "stream")
        rids = _per_item(rid, n, "rid", str) if rid is not None else [uuid.uuid4().hex for _ in range(n)]
        if len(set(rids)) != len(rids):
            raise ValueError("rid values must be unique")
        self.rids = rids
        self.kv_joins = check_kv_joins(kv_joins)
        # the LoRA adapter of each prompt (None: the base model)
        self.lora = _per_item(lora_path, n, "lora_path", str)


def _flag(value, name: str) -> bool:
    """A boolean field: true, false or absent (null); never a string or a number."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {value!r}")
    return bool(value)


def _per_item(value, n: int, name: str, kind: type) -> list:
    """A per-request field given once for all or as a list with one entry per prompt."""
    items = value if isinstance(value, list) else [value] * n
    if len(items) != n:
        raise ValueError(f"{name} has {len(items)} entries for {n} prompts")
    for v in items:
        # bool is an int in Python, not in the API
        if v is not None and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
            raise ValueError(f"{name} must be {'an object' if kind is dict else kind.__name__}, got {v!r}")
    return items


class ReqState:
    """Everything the client knows about one request."""

    def __init__(self, msg: TokenizedGenerateReq, text_in_logprobs: bool):
        self.msg = msg
        self.text_in_logprobs = text_in_logprobs
        self.text = ""
        self.output_ids: list[int] = []
        self.finish: FinishReason | None = None
        self.counts = {"prompt_tokens": len(msg.input_ids), "completion_tokens": 0, "cached_tokens": 0,
                       "reasoning_tokens": 0, "num_retractions": 0}
        self.out_lp: list = []
        self.out_top: list = []
        self.in_lp: list = []
        self.in_top: list = []
        self.sent = {"out_lp": 0, "out_top": 0, "in_lp": 0, "in_top": 0}  # streamed so far
        self.created = time.perf_counter()
        # when its first, latest and the latest but one tokens came (a reply's durations, the metrics' gaps)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.prev_token_at: float | None = None
        self.queue_time: float | None = None
        self.grammar_backend: str | None = None
        self.grammar_narrowed: list[str] = []
        self.spec = (0, 0, 0)  # forwards that verified a speculative draft, its tokens verified, kept
        self.replica = 0  # the data-parallel replica running it
        self.embedding: list[float] | None = None  # an embedding request's pooled state (unnormalized)
        self.changed = asyncio.Event()

    def apply(self, so: StrOut, now: float) -> None:
        o = so.out
        if o.new_ids:
            self.prev_token_at, self.last_token_at = self.last_token_at, now
            self.first_token_at = now if self.first_token_at is None else self.first_token_at
        self.text += so.text
        self.output_ids += o.new_ids
        self.out_lp += o.output_logprobs
        self.out_top += o.output_top_logprobs
        self.in_lp += o.input_logprobs
        self.in_top += o.input_top_logprobs
        self.counts = {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
                       "cached_tokens": o.cached_tokens, "reasoning_tokens": 0,  # no reasoning parser runs
                       "num_retractions": o.num_retractions}
        self.spec = (o.spec_verify_ct, o.spec_drafted, o.spec_accepted)
        if o.queue_time is not None:
            self.queue_time = o.queue_time
        self.grammar_backend = o.grammar_backend or self.grammar_backend
        self.grammar_narrowed = o.grammar_narrowed or self.grammar_narrowed
        if o.embedding is not None:
            self.embedding = o.embedding
        if o.finish is not None:
            self.finish = o.finish
        self.changed.set()


def raise_if_rejected(st: ReqState) -> None:
    """The runtime ended the request with a status: refused what it sent (an invalid grammar: a
    ValueError, 400), failed on it (500), or shut down (503)."""
    f = st.finish
    if f is None or f.type != "abort" or f.status is None:
        return
    if f.status == 400:
        raise ValueError(f.message or "invalid request")
    raise RequestFailed(f.status, f.message or "the request failed")
