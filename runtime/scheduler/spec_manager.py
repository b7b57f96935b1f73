"""SpecManager: drafts and their verification, one path for every kind of draft.

A draft is tokens appended to a request's output that the next forward computes in one extend,
with logits at the last sampled token and at every draft position. Two kinds plan them:
- jump-forward (`jump_forward`): the grammar's forced text (GrammarManager plans it);
- speculative (`speculative`): a guess with no guarantee, here NGRAM prompt lookup
  (runtime/speculative/ngram.py), cut to what the request's grammar allows.

Verification is the same for both: the model picks a token at each position exactly as it would
have decoding one token per step (the same sampler, the same per-request generator, one draw per
emitted token), the draft is kept up to the first position where the pick differs, and that pick
is the step's next token. So a draft never changes what is generated: at temperature 0 the tokens
are the same as without drafts, and a sampled output follows the model's own distribution (a kept
draft token is exactly the token the sampler drew). Rejected positions leave only KV slots past the
sequence's end, which the next tokens overwrite; only kept tokens reach the radix cache.

Adaptive: drafts may add at most `--speculative-token-budget` rows to a forward, less one per
running request (on a CPU a forward of a few rows costs about what one row costs; past ~10 rows it
is compute-bound and drafts stop paying), so a full batch drafts nothing, nor does a step while
requests wait to be admitted (their prefill fills the next forward). Each request's draft is
sized by what it kept lately: about twice its recent kept length, plus one.
"""

from __future__ import annotations

import math

import torch

from plait.runtime.scheduler.grammar_manager import GrammarManager, Masks
from plait.runtime.scheduler.req import Req
from plait.runtime.server_args import ServerArgs
from plait.runtime.speculative.ngram import NgramIndex
from plait.runtime.speculative.verify import walk_draft

_EMA = 0.5  # weight of the latest verify in a request's kept-length average


class SpecManager:
    def __init__(self, args: ServerArgs, tokenizer, grammars: GrammarManager):
        self.args, self.tokenizer, self.grammars = args, tokenizer, grammars
        self.algorithm = args.speculative_algorithm
        self.max_draft = args.speculative_num_draft_tokens - 1
        self.budget = 0  # speculative draft tokens this step may still add
        self.drafted = {"jump_forward": 0, "speculative": 0}  # draft tokens verified, by kind
        self.kept = {"jump_forward": 0, "speculative": 0}  # of which the model kept
        self.spec_verifies = 0  # forwards' verifications of speculative drafts (one per request)

    def begin_step(self, running: int, waiting: int) -> None:
        """Budgets for the drafts planned after this step's forward (they join the next one). No speculative
        drafts while requests wait: their prefill makes the next forward compute-bound anyway."""
        self.budget = 0 if waiting else max(0, self.args.speculative_token_budget - running)
        self.grammars.draft_budget = max(0, self.args.jump_forward_token_budget - running)

    # ---- planning ------------------------------------------------------------------------
    def plan(self, req: Req, context_length: int) -> None:
        """After `req` took its tokens: a speculative draft, where nothing else was drafted."""
        if self.algorithm is None or req.finish is not None or req.draft or self.budget <= 0:
            return
        if req.grammar is not None and (req.return_logprob or req.params.has_penalties):
            return  # constrained picks over a draft are masked per position: no per-token logprobs or penalties
        left = min(req.params.max_new_tokens - req.output_len, context_length - req.seq_len) - 1
        size = min(self.max_draft, self.budget, left, 1 + math.ceil(2 * req.spec_accept_ema))
        if size <= 0:
            return
        if req.ngram is None:
            req.ngram = NgramIndex(self.args.speculative_ngram_min_match_window_size,
                                   self.args.speculative_ngram_max_match_window_size)
            req.spec_accept_ema = self.max_draft / 2  # optimistic until measured
        draft = req.ngram.propose(req.fill_ids, size)
        if draft and req.grammar is not None:
            draft = self.grammars.admissible(req, draft)
        if draft:
            self.budget -= len(draft)
            req.set_draft(draft, "speculative")

    # ---- verification --------------------------------------------------------------------
    def verify(self, req: Req, rows: torch.Tensor, masks: Masks | None, eos_ids: set[int],
               context_length: int) -> None:
        """rows: logits at the last sampled token and at each draft position (1 + len(draft))."""
        draft, kind = req.draft, req.draft_kind
        logprobs = None
        if req.grammar is not None:
            kept, tok, accepted = self.grammars.pick_verified(req, rows, masks)
        else:
            kept, tok, logprobs = walk_draft(req, rows, eos_ids)
            accepted = False
        self.drafted[kind] += len(draft)
        self.kept[kind] += kept
        if kind == "speculative":
            self.spec_verifies += 1
            req.spec_verify_ct += 1
            req.spec_drafted += len(draft)
            req.spec_accepted += kept
            req.spec_accept_ema = (1 - _EMA) * req.spec_accept_ema + _EMA * kept
        self._commit(req, kept, tok, logprobs, accepted, eos_ids, context_length)

    def _commit(self, req: Req, kept: int, tok: int, logprobs, accepted: bool, eos_ids: set[int],
                context_length: int) -> None:
        """Keep the first `kept` draft tokens and then `tok`, stopping where the request finishes (a stop
        token or string, max_new_tokens inside the kept run)."""
        draft = req.draft
        base = req.output_len - len(draft)
        del req.output_ids[base:]
        req.draft = []
        computed = req.seq_len + kept  # the forward computed the kept tokens' KV, not the next token's
        tokens = draft[:kept] + [tok]
        for i, t in enumerate(tokens):
            req.output_ids.append(t)
            req.pending_ids.append(t)
            if logprobs is not None:
                req.pending_logprobs.append(logprobs[i][0])
                if req.top_logprobs_num:
                    req.pending_top.append(logprobs[i][1] or [])
            if i == kept and req.grammar is not None:
                self.grammars.on_token(req, t, eos_ids, context_length, accepted=accepted)
            else:
                req.check_finished(eos_ids, self.tokenizer, context_length)
            if req.finish is not None:
                break
        req.cached_len = min(computed, req.seq_len)

    def stats(self) -> dict:
        spec = self.drafted["speculative"]
        return {
            "tokens_jumped": self.kept["jump_forward"], "tokens_drafted": self.drafted["jump_forward"],
            "spec_algorithm": self.algorithm, "spec_verifies": self.spec_verifies,
            "spec_draft_tokens": spec, "spec_accepted_tokens": self.kept["speculative"],
            "spec_accept_rate": round(self.kept["speculative"] / spec, 4) if spec else None,
            # tokens each verify yields: the kept draft and the model's own next token
            "spec_accept_length": round(1 + self.kept["speculative"] / self.spec_verifies, 4)
            if self.spec_verifies else None,
        }
