"""Typed messages between the runtime's processes (msgspec structs as msgpack; never pickle).

    client --ToScheduler--> scheduler --ToDetokenizer--> detokenizer --ToClient--> client

Each socket carries a tagged union, so a receiver decodes exactly the types it accepts.
Control replies (flush, server info) travel the same path as tokens and pass the detokenizer
unchanged, so a client reads a single socket.
"""

from __future__ import annotations

import msgspec

from plait.runtime.sampling.params import SamplingParams


class EmbedSpec(msgspec.Struct, frozen=True):
    """Asks for the prompt's embedding instead of new tokens: its final hidden states pooled (the vector comes
    back unnormalized in TokenOut.embedding)."""

    pooling: str = ""  # "last", "mean" or "cls" (model_config.POOLINGS); "": the model's own
    encoder: bool = False  # computed by the server's --embedding-model, not its main model


class TokenizedGenerateReq(msgspec.Struct, frozen=True, tag=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output logprobs only
    top_logprobs_num: int = 0
    stream: bool = False
    group: str = ""  # sequences of one client request (a batch, n choices) share a group; "" alone
    kv_joins: list[str] = []  # concate_and_append joins whose KV this request may reuse (JoinKVReq)
    embed: EmbedSpec | None = None  # an embedding request (max_new_tokens 0)
    lora: str | None = None  # the LoRA adapter it runs with (by name), None: the base model


class AbortReq(msgspec.Struct, frozen=True, tag=True):
    rid: str


# the finish messages of a constrained request cut at its budget: closed (complete, cut short) or not
GRAMMAR_CLOSED = "max_new_tokens was near: the grammar was closed early, so the output is complete but cut short"
GRAMMAR_CUT = "max_new_tokens (or the context length) was reached before the grammar's end was generated"


class FinishReason(msgspec.Struct, frozen=True):
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    message: str | None = None
    # an abort with a status for the client: 400 (what it sent, e.g. a bad grammar), 500 (a bug met
    # while serving it; other requests go on), 503 (the runtime died or shut down)
    status: int | None = None

    def to_json(self) -> dict:
        out: dict = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        if self.message:
            out["message"] = self.message
        return out


class DecodeSpec(msgspec.Struct, frozen=True):
    """How to turn a request's ids into text; travels with its first output to the detokenizer."""

    stop: list[str] = []
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True


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
    queue_time: float | None = None  # seconds waited before admission, on the request's first output
    num_retractions: int = 0  # times the request was sent back to the queue to free KV
    decode: DecodeSpec | None = None  # on the request's first output
    grammar_backend: str | None = None  # the backend that compiled the request's grammar, if it has one
    grammar_narrowed: list[str] = []  # how its JSON schema was narrowed (on the request's first output)
    spec_verify_ct: int = 0  # forwards that verified a speculative draft of the request, so far
    spec_drafted: int = 0  # speculative draft tokens verified, so far
    spec_accepted: int = 0  # of which kept
    embedding: list[float] | None = None  # an embedding request's pooled vector, on its last output


class BatchTokenOut(msgspec.Struct, tag=True):
    """Scheduler -> detokenizer: every request's progress in one step."""

    outs: list[TokenOut]


class StrOut(msgspec.Struct):
    """One request's progress with its newly visible text (stop strings already trimmed)."""

    out: TokenOut
    text: str


class BatchStrOut(msgspec.Struct, tag=True):
    """Detokenizer -> client."""

    outs: list[StrOut]


class FlushCacheReq(msgspec.Struct, frozen=True, tag=True):
    req_id: str


class ServerInfoReq(msgspec.Struct, frozen=True, tag=True):
    req_id: str


class JoinKVReq(msgspec.Struct, frozen=True, tag=True):
    """concate_and_append: build the KV of parts[0] + each later part's tokens after fork_len from
    the parts' cached KV (they share their first fork_len tokens). The reply's info carries
    join_id (for later requests' kv_joins), input_ids (the joined sequence) and reused, or reason."""

    req_id: str
    parts: list[list[int]]
    fork_len: int
    kv_joins: list[str] = []  # joins the parts themselves were computed under


class LoadLoRAReq(msgspec.Struct, frozen=True, tag=True):
    """Register a LoRA adapter (runtime/lora); the reply's info: {"adapters"} or {"error"}."""

    req_id: str
    name: str
    path: str


class UnloadLoRAReq(msgspec.Struct, frozen=True, tag=True):
    """Unregister a LoRA adapter (the requests running with it finish first); the reply as LoadLoRAReq's."""

    req_id: str
    name: str


class ControlReply(msgspec.Struct, frozen=True, tag=True):
    """The scheduler's answer to a FlushCacheReq, ServerInfoReq or JoinKVReq with the same req_id."""

    req_id: str
    ok: bool
    info: dict = {}


class SchedulerStats(msgspec.Struct, frozen=True, tag=True):
    """Sent by the scheduler about once a second while it works (and once when it goes idle)."""

    num_running: int
    num_waiting: int
    kv_used: int
    kv_capacity: int
    cache_hit_rate: float
    gen_throughput: float  # output tokens per second over the last interval
    replica: int = 0  # the data-parallel replica whose scheduler sent it


ToScheduler = TokenizedGenerateReq | AbortReq | FlushCacheReq | ServerInfoReq | JoinKVReq | LoadLoRAReq | UnloadLoRAReq
ToDetokenizer = BatchTokenOut | ControlReply | SchedulerStats
ToClient = BatchStrOut | ControlReply | SchedulerStats
