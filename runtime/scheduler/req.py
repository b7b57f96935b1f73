"""Req: one sequence in the scheduler.

Lengths, named the same everywhere:
- `cached_len`: leading tokens of `fill_ids` whose KV is in the pool (shared from the radix
  tree or computed for this request);
- `tree_len`: leading tokens whose KV belongs to the radix tree (locked through `last_node`);
- `alloc_len`: tokens that have KV slots in the request's row (>= cached_len);
- `window_released`: leading tokens whose window slots (sliding-window layers) it no longer holds;
- `output_len`: generated tokens.
"""

from __future__ import annotations

import time

import torch

from plait.runtime.ipc.messages import FinishReason, TokenizedGenerateReq
from plait.runtime.sampling.params import SamplingParams


class Req:
    def __init__(self, msg: TokenizedGenerateReq, seed: int):
        self.rid = msg.rid
        self.group = msg.group
        self.origin_input_ids: list[int] = list(msg.input_ids)
        self.output_ids: list[int] = []
        self.params: SamplingParams = msg.sampling_params
        self.return_logprob = msg.return_logprob
        self.logprob_start_len = msg.logprob_start_len
        self.top_logprobs_num = msg.top_logprobs_num
        self.kv_joins: tuple[str, ...] = tuple(msg.kv_joins)
        self.generator = torch.Generator().manual_seed(msg.sampling_params.seed if msg.sampling_params.seed is not None else seed)

        self.grammar = None  # Matcher once compiled (constrained requests)
        self.grammar_compile = None  # its constrained/base.Compile while the grammar compiles
        self.grammar_backend: str | None = None  # the backend that compiled it (auto picks per request)
        self.grammar_narrowed: list[str] = []  # how its JSON schema was narrowed (schema_policy.py)
        self.close_plan: list[int] | None = None  # the grammar's last planned completion (closing.py)
        self.close_retry_left: int | None = None  # with no plan: search again once the tokens left fall to this
        self.close_longest = 0  # the longest plan so far: how much one token may lengthen the completion
        self.close_required: frozenset[str] | None = None  # prefixes of the names its JSON schema requires (closing.py)
        self.draft: list[int] = []  # drafted tokens at the end of output_ids, not yet verified
        # leading draft tokens that are the grammar's forced text (jump-forward); the rest are speculative guesses
        self.draft_forced = 0
        self.draft_parents: list[int] | None = None  # a draft tree: the node each node follows (-1: last sampled)
        self.verified_rows: list[int] | None = None  # rows of the last verify in position order (a tree's path first)
        self.spec_verify_ct = 0  # forwards that verified a speculative draft of this request
        self.spec_drafted = 0  # speculative draft tokens verified
        self.spec_accepted = 0  # of which the model kept
        self.spec_accept = None  # its speculative/cost.Acceptance of recent drafts once it drafts (sizes the next)
        self.row: int | None = None
        self.last_node = None
        self.cached_len = 0
        self.tree_len = 0
        self.alloc_len = 0
        self.window_released = 0
        self.window_covered = 0  # cached tokens whose window slots it locks in the tree (KVManager)
        self.cached_tokens = -1  # prompt tokens served from the radix cache at admission; -1 until admitted
        self.num_retractions = 0
        self.finish: FinishReason | None = None
        self.failed = False  # ended by a fault of its own (faults.py)
        self.arrival = time.perf_counter()
        self.queue_time: float | None = None  # set at first admission
        self.queue_time_sent = False
        self.decode_sent = False
        self.input_logprobs_done = False

        # deltas not yet sent
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[tuple[float, int]] = []
        self.pending_top: list[list[tuple[float, int]]] = []
        self.pending_input_logprobs: list[tuple[float | None, int]] = []
        self.pending_input_top: list[list[tuple[float, int]] | None] = []

    def set_draft(self, draft: list[int], forced: bool, parents: list[int] | None = None) -> None:
        """Append a draft to output_ids: the grammar's forced text (`forced`) or a speculative guess (a tree's
        nodes, parents first, when `parents` is given); the next forward computes it and the model verifies it."""
        self.draft, self.draft_forced, self.draft_parents = draft, len(draft) if forced else 0, parents
        self.output_ids.extend(draft)

    def add_guess(self, guess: list[int]) -> None:
        """A speculative guess after the forced text already drafted (verified in the same forward)."""
        self.draft = self.draft + guess
        self.output_ids.extend(guess)

    @property
    def guess_len(self) -> int:
        """Speculative draft tokens (after any forced ones)."""
        return len(self.draft) - self.draft_forced

    def drop_draft(self, guess_only: bool = False) -> None:
        """Forget an unverified draft (the request is being retracted or failed), or only its guess."""
        drop = self.guess_len if guess_only else len(self.draft)
        if drop:
            del self.output_ids[-drop:]
            self.draft, self.draft_parents = self.draft[: len(self.draft) - drop], None
        if not self.draft:
            self.draft_forced = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def pending_len(self) -> int:
        """Tokens still to compute before the next sample (1 while decoding)."""
        return self.seq_len - self.cached_len

    def remaining_tokens(self) -> int:
        return max(self.params.max_new_tokens - self.output_len, 0)

    def input_logprob_start(self) -> int:
        """First prompt position whose input logprob is reported, or prompt_len if none."""
        if not self.return_logprob or self.logprob_start_len < 0 or self.input_logprobs_done:
            return self.prompt_len
        return min(self.logprob_start_len, self.prompt_len)

    def max_prefix_match(self) -> int:
        """Prompt logprobs need logits, so positions they read may not come from the cache."""
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
                self.finish = FinishReason("stop", matched=last)
                return
            if p.stop:
                window = max(len(s) for s in p.stop) + 4
                tail = tokenizer.decode(self.output_ids[-window:], skip_special_tokens=p.skip_special_tokens)
                for s in p.stop:
                    if s in tail:
                        self.finish = FinishReason("stop", matched=s)
                        return
        if self.output_len >= p.max_new_tokens:
            self.finish = FinishReason("length", matched=None)
        elif self.seq_len >= context_length:
            self.finish = FinishReason("length", message="context length reached")
