"""Req: one sequence in the scheduler, and the parts of it that one component each writes.

A request's own fields (its input, sampling parameters, committed output, how it ended) are set here and by
the two functions that grow and end it (`req_io.take_token`, `Req.end`). Everything else lives in a part with
one writer; the others only read it:

- `kv` (KVState): its KV row, slots and radix-tree lock: KVManager;
- `constraint` (Constraint): its grammar's compile, matcher and closing plan: GrammarManager;
- `draft` (Draft): tokens drafted for the next forward to verify, and how its drafts fared: SpecManager;
- `stream` (Stream): the deltas its next TokenOut carries: req_io;
- `embedding` (pooling.Embedding, embedding requests only): its pooled hidden states: pooling.py.

Lengths, named the same everywhere:
- `seq_len`: prompt + output tokens (committed; a draft is not output until verified);
- `fill_len`: seq_len + the draft: the tokens forwards compute, `fill_ids`;
- `kv.cached_len`: leading tokens of `fill_ids` whose KV is in the pool (shared from the radix tree or
  computed for this request); `kv.tree_len`: of which the radix tree owns (locked through `kv.last_node`);
- `kv.alloc_len`: tokens with KV slots in the request's row (>= cached_len);
- `kv.window_released`: leading tokens whose window slots (sliding-window layers) it no longer holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from plait.runtime.ipc.messages import FinishReason, TokenizedGenerateReq
from plait.runtime.sampling.params import SamplingParams
from plait.runtime.scheduler.pooling import Embedding


@dataclass
class KVState:
    """Where the request's KV is: written by KVManager only."""

    row: int | None = None  # its row of the request-to-token table while admitted
    last_node: object = None  # the radix node locking the prefix it shares
    cached_len: int = 0
    tree_len: int = 0
    alloc_len: int = 0
    window_released: int = 0
    window_covered: int = 0  # cached tokens whose window slots it locks in the tree


@dataclass
class Constraint:
    """A constrained request's grammar: written by GrammarManager only."""

    compile: object = None  # its constrained/base.Compile while the grammar compiles
    matcher: object = None  # its Matcher once compiled; a closing.ClosingMatcher once the closing took over
    closing: bool = False  # whether `matcher` is the closing's
    backend: str | None = None  # the backend that compiled it (auto picks per request)
    narrowed: list[str] = field(default_factory=list)  # how its JSON schema was narrowed (schema_policy.py)
    close_plan: list[int] | None = None  # the last planned completion (closing.py)
    close_retry_left: int | None = None  # with no plan: search again once the tokens left fall to this
    close_longest: int = 0  # the longest plan so far: how much one token may lengthen the completion
    close_required: frozenset[str] | None = None  # prefixes of the names its JSON schema requires


@dataclass
class Draft:
    """Tokens after the output that the next forward computes and the model verifies: written by SpecManager only."""

    tokens: list[int] = field(default_factory=list)
    forced: int = 0  # leading tokens that are the grammar's forced text (jump-forward); the rest are guesses
    parents: list[int] | None = None  # a draft tree: the node each node follows (-1: the last sampled token)
    verified_rows: list[int] | None = None  # rows of the last verify in position order (a tree's path first)
    acceptance: object = None  # its speculative/cost.Acceptance of recent drafts, once it drafts
    verifies: int = 0  # forwards that verified a speculative draft of this request
    drafted: int = 0  # speculative draft tokens verified
    accepted: int = 0  # of which the model kept

    @property
    def guess_len(self) -> int:
        """Speculative draft tokens (after any forced ones)."""
        return len(self.tokens) - self.forced


@dataclass
class Stream:
    """What the request's next TokenOut carries: written by req_io only."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, int]] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_logprobs_done: bool = False
    queue_time_sent: bool = False
    decode_sent: bool = False


class Req:
    def __init__(self, msg: TokenizedGenerateReq, seed: int, pooling: str | None = None, whole: bool = False,
                 lora_slot: int = -1):
        """`pooling`: an embedding request's (resolved: the model's where it names none); `whole`: its prompt is
        computed in one forward, none of it cached (an encoder's tokens attend both ways); `lora_slot`: the slot
        of the LoRA adapter it runs with (-1: none), held for it by the runner's LoRAManager."""
        self.rid = msg.rid
        self.group = msg.group
        self.origin_input_ids: list[int] = list(msg.input_ids)
        self.output_ids: list[int] = []  # committed tokens only (req_io.take_token)
        self.params: SamplingParams = msg.sampling_params
        self.return_logprob = msg.return_logprob
        self.logprob_start_len = msg.logprob_start_len
        self.top_logprobs_num = msg.top_logprobs_num
        self.kv_joins: tuple[str, ...] = tuple(msg.kv_joins)
        self.generator = torch.Generator().manual_seed(msg.sampling_params.seed if msg.sampling_params.seed is not None else seed)
        self.kv = KVState()
        self.constraint = Constraint()
        self.draft = Draft()
        self.stream = Stream()
        self.embedding = Embedding(pooling) if pooling is not None else None
        self.whole = whole
        self.lora, self.lora_slot = msg.lora, lora_slot
        self.finish: FinishReason | None = None  # how it ended (end)
        self.failed = False  # ended by a fault of its own (faults.py)
        self.arrival = time.perf_counter()
        # admission's: the first wait in the queue, and how often it gave its KV back
        self.queue_time: float | None = None
        self.num_retractions = 0
        self.cached_tokens = -1  # KVManager's: prompt tokens served from the radix cache at first admission

    def end(self, reason: FinishReason, failed: bool = False) -> None:
        self.finish = reason
        self.failed = self.failed or failed

    @property
    def cache_namespace(self) -> str:
        """Where its KV is cached: a LoRA adapter's KV is its own (a slot is never reused: a reloaded adapter starts
        afresh)."""
        return f"lora{self.lora_slot}" if self.lora_slot >= 0 else ""

    @property
    def matcher(self):
        """Its grammar's matcher (None: unconstrained, or still compiling)."""
        return self.constraint.matcher

    @property
    def fill_ids(self) -> list[int]:
        """The tokens forwards compute: prompt, output and any draft."""
        return self.origin_input_ids + self.output_ids + self.draft.tokens

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def fill_len(self) -> int:
        return self.seq_len + len(self.draft.tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def pending_len(self) -> int:
        """Tokens still to compute before the next sample or verify (1 while decoding without a draft)."""
        return self.fill_len - self.kv.cached_len

    def remaining_tokens(self) -> int:
        return max(self.params.max_new_tokens - self.output_len, 0)

    def input_logprob_start(self) -> int:
        """First prompt position whose input logprob is reported, or prompt_len if none."""
        if not self.return_logprob or self.logprob_start_len < 0 or self.stream.input_logprobs_done:
            return self.prompt_len
        return min(self.logprob_start_len, self.prompt_len)

    def max_prefix_match(self) -> int:
        """Prompt logprobs need logits, so positions they read may not come from the cache; nor may the states
        an embedding pools."""
        if self.whole or (self.embedding is not None and self.embedding.whole_prompt):
            return 0
        start = self.input_logprob_start()
        if start < self.prompt_len:
            return max(start - 1, 0)
        return self.seq_len - 1  # at least one token must be computed to get logits

    def check_finished(self, eos_ids: set[int], tokenizer, context_length: int) -> None:
        if self.finish is not None:
            return
        last = self.output_ids[-1] if self.output_ids else None
        p = self.params
        if last is not None and self.output_len >= p.min_new_tokens:
            if last in p.stop_token_ids or (not p.ignore_eos and last in eos_ids):
                self.end(FinishReason("stop", matched=last))
                return
            if p.stop:
                window = max(len(s) for s in p.stop) + 4
                tail = tokenizer.decode(self.output_ids[-window:], skip_special_tokens=p.skip_special_tokens)
                for s in p.stop:
                    if s in tail:
                        self.end(FinishReason("stop", matched=s))
                        return
        if self.output_len >= p.max_new_tokens:
            self.end(FinishReason("length", matched=None))
        elif self.seq_len >= context_length:
            self.end(FinishReason("length", message="context length reached"))
