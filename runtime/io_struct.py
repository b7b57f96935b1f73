"""Typed messages between the frontend side and the scheduler (msgspec structs; msgpack on a socket)."""

from __future__ import annotations

import msgspec

from plait.runtime.sampling.params import SamplingParams


class TokenizedGenerateReq(msgspec.Struct, frozen=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output logprobs only
    top_logprobs_num: int = 0
    stream: bool = False


class AbortReq(msgspec.Struct, frozen=True):
    rid: str


class FinishReason(msgspec.Struct, frozen=True):
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    message: str | None = None

    def to_json(self) -> dict:
        out: dict = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        if self.message:
            out["message"] = self.message
        return out


class TokenOut(msgspec.Struct):
    """One request's progress in one scheduler step (deltas since the previous TokenOut)."""

    rid: str
    new_ids: list[int]
    finish: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: list[tuple[float, int]] = []
    output_top_logprobs: list[list[tuple[float, int]]] = []
    input_logprobs: list[tuple[float | None, int]] = []
    input_top_logprobs: list[list[tuple[float, int]] | None] = []
