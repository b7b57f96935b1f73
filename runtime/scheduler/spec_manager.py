"""SpecManager: drafts and their verification, one path for every kind of draft.

A draft (`Req.draft`, this manager's alone to write) is tokens after a request's output that the next forward
computes in one extend, with logits at the last sampled token and at every draft position; they become output
only as the model verifies them. Two kinds plan them:
- jump-forward (`draft.forced` leading tokens): the grammar's forced text (GrammarManager plans it);
- speculative (the rest, `draft.guess_len`): a guess with no guarantee, cut to what the request's grammar
  allows, from the drafter `--speculative-algorithm` names (runtime/speculative/drafter.py: EAGLE heads,
  NGRAM and SUFFIX lookups). A lookup's guess may follow forced text in the same draft; a model's cannot,
  having no features or K/V for tokens the target has not computed.

Verification is the same for both: the model picks a token at each position exactly as it would
have decoding one token per step (the same sampler, the same per-request generator, one draw per
emitted token), the draft is kept up to the first position where the pick differs, and that pick
is the step's next token. So a draft never changes what is generated: at temperature 0 the tokens
are the same as without drafts, and a sampled output follows the model's own distribution (a kept
draft token is exactly the token the sampler drew). Rejected positions leave only KV slots past the
sequence's end, which the next tokens overwrite; only kept tokens reach the radix cache.

Adaptive: drafts may add at most `--speculative-token-budget` rows to a forward, less one per
running request, so a full batch drafts nothing, nor does a step while requests wait to be admitted
(their prefill fills the next forward). Within that, `--speculative-draft-policy measured` (the
default) weighs each request's per-token acceptance against the measured time of forwards by row
count and of draft steps (runtime/speculative/cost.py): whether extra rows are nearly free depends on
the CPU and the weight format, so it is measured, not assumed. A request left without a draft drifts
back toward the prior acceptance and is tried again. What that model leaves out (the head's pass over
every committed position, the verify walk, Python) is caught by a second measurement: the realized
tokens a second of whole decode steps with and without drafts, per number of running requests; where
drafting measured slower, that batch size drafts only one step in 16 (to keep the figure current).
`fixed` drafts every request's most each step.
While the row budget leaves no room for drafts (a full batch, a queue), the drafter is told (`no_room`): an
EAGLE head then skips its pass over decoded positions.
"""

from __future__ import annotations

import logging

import torch
from plait.runtime.forward.batch import ForwardMode, tree_depths
from plait.runtime.scheduler.grammar_manager import GrammarManager, Masks
from plait.runtime.scheduler.kv_manager import KVManager
from plait.runtime.scheduler.req import Req
from plait.runtime.scheduler.req_io import take_token
from plait.runtime.scheduler.step import Step
from plait.runtime.speculative.config import DraftConfig
from plait.runtime.speculative.cost import Acceptance, RowCost, StepRate, choose_sizes, fill_caps, running_mean
from plait.runtime.speculative.drafter import Committed, Drafter, DraftStep
from plait.runtime.speculative.verify import sampler_picks, walk

_EMA = 0.3  # weight of the latest measurement in the running means of a draft step and of a step's overhead
# a batch size whose steps with drafts measured fewer tokens a second than its steps without drafts still
# drafts once in this many steps, so its rate stays current
_PROBE_EVERY = 16

logger = logging.getLogger(__name__)


class SpecManager:
    def __init__(self, args: DraftConfig, tokenizer, grammars: GrammarManager, kv: KVManager,
                 drafter: Drafter | None = None):
        self.args, self.tokenizer, self.grammars, self.kv = args, tokenizer, grammars, kv
        self.algorithm = args.speculative_algorithm
        self.drafter = drafter
        self.trees = drafter is not None and drafter.drafts_trees
        self.max_nodes = args.speculative_num_draft_tokens - 1  # draft tokens one verify may hold
        self.max_draft = min(args.speculative_num_steps or self.max_nodes, self.max_nodes)  # chain length / tree depth
        self.budget = 0  # speculative draft tokens this step may still add
        self.jumped_before = 0  # forced draft tokens kept before this step's verifications
        self.no_room = False  # the row budget (or a queue) leaves no room for drafts this step
        self.base_rows = 0  # rows the next forward holds without drafts
        self.cost = RowCost()
        self.pass_cost = RowCost()  # a draft pass's wall time by requests drafting (a model drafter's; lookups take none)
        self.forward_seconds = 0.0  # the latest decode forward's wall time
        self.overhead = 0.0  # running mean of a decode step's wall time beyond its forward and its draft steps
        self.drafting_seconds = 0.0  # this step's draft steps (priced apart, by pass_cost)
        # realized tokens a second of whole decode steps (forward, verify, sampling, the head's pass, drafting),
        # by running requests, for steps that verified speculative drafts (True) and steps that did not (False):
        # what the cost model leaves out (the walk, the head, Python) is in these
        self.realized: dict[int, dict[bool, StepRate]] = {}
        self.held_back: dict[int, int] = {}  # steps drafting was held back, by running requests
        self.drafted = {"jump_forward": 0, "speculative": 0}  # draft tokens verified, by kind
        self.kept = {"jump_forward": 0, "speculative": 0}  # of which the model kept
        self.spec_verifies = 0  # forwards' verifications of speculative drafts (one per request)
        self.seeded_verifies = 0  # of which the guess followed the grammar's forced text in the same draft

    @property
    def capture(self) -> tuple[int, ...]:
        """The target layers whose features the drafter reads (none without one)."""
        return self.drafter.capture if self.drafter is not None else ()

    def release(self, req: Req) -> None:
        """`req` ended: its draft goes, and the drafter forgets it."""
        self.drop(req)
        if self.drafter is not None:
            self.drafter.release(req)

    # ---- the request's draft: set and dropped here only ----------------------------------
    def force(self, req: Req, forced: list[int]) -> None:
        """The grammar's forced text after the request's last token (jump-forward) becomes its draft."""
        if forced:
            req.draft.tokens, req.draft.forced, req.draft.parents = list(forced), len(forced), None

    def _guess(self, req: Req, tokens: list[int], parents: list[int] | None = None) -> None:
        """A speculative guess, after any forced text already drafted (a tree's nodes, parents first, when
        `parents` is given; only without forced text)."""
        d = req.draft
        d.tokens, d.parents = d.tokens + tokens, parents

    def drop(self, req: Req, guess_only: bool = False) -> None:
        """Forget an unverified draft (the request is retracted or ended), or only its guess."""
        d = req.draft
        d.tokens, d.parents = (d.tokens[: d.forced], None) if guess_only else ([], None)
        d.forced = len(d.tokens)

    def flush(self) -> None:
        """The caches are flushed: the drafter forgets earlier requests too."""
        if self.drafter is not None:
            self.drafter.flush()

    def copy_kv(self, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor) -> None:
        """A KV join: the drafter's K/V at the target's slots follow the target's."""
        if self.drafter is not None:
            self.drafter.copy_kv(src, dst, shift)

    def set_budget(self, running: int, waiting: int) -> None:
        """Budgets for the drafts planned after this step's forward (they join the next one). No speculative
        drafts while requests wait: their prefill makes the next forward compute-bound anyway."""
        # no room for drafts at all (a full batch, a queue): the head may skip decoded positions. Not where drafts
        # are only held back for measuring slower: the head's gaps would make the probes measure worse still
        self.no_room = bool(waiting) or self.args.speculative_token_budget <= running
        self.budget = 0 if self.no_room or not self._drafts_pay(running) else \
            self.args.speculative_token_budget - running
        self.base_rows = running
        self.jumped_before = self.kept["jump_forward"]  # record_step leaves out what this step's forced text kept
        self.drafting_seconds = 0.0

    # ---- planning ------------------------------------------------------------------------
    def plan(self, took: list[Req], step: Step, features: list | None, context_length: int) -> None:
        """After the step's tokens are committed: speculative drafts for the requests in `took` (those that
        took tokens) that drafted nothing else (or only forced text, where the drafter may follow it). The
        drafter first sees every position the forward committed (`features`: the target's, per work item).
        Drafts only save time: a fault while planning them costs this step its drafts, nothing else."""
        if self.drafter is None:
            return
        try:
            self._plan(took, step, features, context_length)
        except Exception:  # noqa: BLE001
            logger.exception("planning speculative drafts failed; this step drafts nothing")
            for req in took:
                self.drop(req, guess_only=True)
        finally:
            for p in step.planned:  # the drafter has read the features of a tree's kept path
                p.req.draft.verified_rows = None

    def _plan(self, took: list[Req], step: Step, features: list | None, context_length: int) -> None:
        caps = {req: self._cap(req, context_length) for req in took}
        cands = [req for req, cap in caps.items() if cap > 0]
        limits = [caps[r] for r in cands]
        if self.args.speculative_draft_policy == "fixed":
            chosen = fill_caps(limits, self.budget)
        else:
            chosen = choose_sizes(self.cost, self.base_rows, [r.draft.acceptance for r in cands], limits, self.budget,
                                  self.pass_cost, self.overhead)
        for req, n in zip(cands, chosen):
            if n == 0:  # no verify will update its acceptance: drift back to the prior, so it is tried again
                req.draft.acceptance.relax()
        sizes = {req: n for req, n in zip(cands, chosen) if n > 0}
        self.budget -= sum(sizes.values())
        depths = {req: min(self.max_draft, self._left(req, context_length)) for req in sizes if self._tree(req)}
        # the committed positions only: a failed request's unverified draft is not the sequence's
        committed = [Committed(p.req, p.item.cached_len, max(0, min(p.req.kv.cached_len, p.req.seq_len) - p.item.cached_len),
                               None if features is None else features[i], p.work.mode is ForwardMode.EXTEND)
                     for i, p in enumerate(step.planned)]
        proposal = self.drafter.propose(DraftStep(committed, sizes, depths, self.no_room))
        self.drafting_seconds = proposal.seconds
        if proposal.steps:
            self.pass_cost.record(len(sizes), proposal.seconds / proposal.steps)
        for req, size in sizes.items():
            draft = proposal.drafts.get(req)
            tokens = draft.tokens if draft is not None else []
            if tokens and draft.parents is None and req.matcher is not None:
                tokens = self.grammars.admissible(req, tokens)
            self.budget += size - len(tokens)
            if tokens:
                self._guess(req, tokens, draft.parents)

    @staticmethod
    def _left(req: Req, context_length: int) -> int:
        """Draft tokens that fit before the request's length limits (its next token after them included)."""
        return min(req.params.max_new_tokens - req.output_len, context_length - req.seq_len) - len(req.draft.tokens) - 1

    def _cap(self, req: Req, context_length: int) -> int:
        """The most tokens `req` may draft now (0: none); `choose_sizes` decides how many pay."""
        if req.finish is not None or self.budget <= 0:
            return 0
        if req.draft.tokens and (req.draft.guess_len or not self.drafter.follows_forced):
            return 0  # a guess after forced text the model has not verified: only a lookup can make one
        if req.matcher is not None and (req.return_logprob or req.params.has_penalties):
            return 0  # constrained picks over a draft are masked per position: no per-token logprobs or penalties
        if req.draft.acceptance is None:
            req.draft.acceptance = Acceptance()
        return max(0, min(self.max_nodes if self._tree(req) else self.max_draft, self._left(req, context_length)))

    def record_step(self, requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A whole decode step: its requests, whether it verified speculative drafts, tokens it emitted. The
        grammar's forced tokens kept are left out: jump-forward runs with or without guesses, and counting
        what it keeps would credit whichever side happened to verify forced text."""
        if seconds <= 0:
            return
        beyond = seconds - self.forward_seconds - self.drafting_seconds
        self.overhead = running_mean(self.overhead or None, max(0.0, beyond), _EMA)
        tokens -= self.kept["jump_forward"] - self.jumped_before
        self.realized.setdefault(requests, {}).setdefault(drafted, StepRate()).add(tokens, seconds)

    def _drafts_pay(self, requests: int) -> bool:
        """False while, at this many running requests, steps with drafts measured slower than steps without
        (under the measured policy; the fixed policy always drafts), but for a probe now and then."""
        rates = self.realized.get(requests, {})
        if self.args.speculative_draft_policy == "fixed" or len(rates) < 2 or rates[True].rate >= rates[False].rate:
            return True
        self.held_back[requests] = self.held_back.get(requests, 0) + 1
        if self.held_back[requests] % _PROBE_EVERY == 0:
            return True
        return False

    def record_forward(self, rows: int, seconds: float) -> None:
        """The wall time of a forward of decode and verify rows only (the cost drafts are weighed by)."""
        self.cost.record(rows, seconds)
        self.forward_seconds = seconds

    def _tree(self, req: Req) -> bool:
        """Whether `req` drafts a tree (a drafter of trees; a grammar cuts chains only)."""
        return self.trees and req.matcher is None

    # ---- verification --------------------------------------------------------------------
    def verify(self, req: Req, rows: torch.Tensor, masks: Masks | None, eos_ids: set[int],
               context_length: int) -> None:
        """rows: logits at the last sampled token and at each draft position (1 + len(draft))."""
        d = req.draft
        forced, parents = d.forced, d.parents
        logprobs = None
        if req.matcher is not None:
            kept, tok, accepted = self.grammars.pick_verified(req, rows, masks)
        else:
            picked: list = []  # each pick's logprobs, with return_logprob
            path, tok = walk(d.tokens, parents, sampler_picks(req, rows, eos_ids, picked))
            logprobs = picked if req.return_logprob else None
            if parents is not None:
                self._linearize(req, path)
            kept = len(path)
            accepted = False
        self.drafted["jump_forward"] += forced
        self.kept["jump_forward"] += min(kept, forced)
        guessed, guessed_kept = d.guess_len, kept - forced
        if guessed and guessed_kept >= 0:  # a guess after forced text the model rejected was never tried
            self.drafted["speculative"] += guessed
            self.kept["speculative"] += guessed_kept
            self.spec_verifies += 1
            self.seeded_verifies += forced > 0
            d.verifies += 1
            d.drafted += guessed
            d.accepted += guessed_kept
            # the tokens whose fate this verify decided: the kept ones and the miss, if any
            deepest = guessed if parents is None else max(tree_depths(parents))
            d.acceptance.update(guessed_kept, guessed_kept + (1 if guessed_kept < deepest else 0))
        self._commit(req, kept, tok, logprobs, accepted, eos_ids, context_length)

    def _linearize(self, req: Req, path: list[int]) -> None:
        """Put a tree's kept path first: its nodes' tokens and KV slots (each computed at its depth's position)
        move to the positions right after the sampled token, so the kept run is an ordinary prefix."""
        d = req.draft
        order = path + [i for i in range(len(d.tokens)) if i not in set(path)]
        self.kv.move_draft_slots(req, order)
        d.tokens, d.parents = [d.tokens[i] for i in order], None
        d.verified_rows = [0] + [1 + i for i in order]

    def _commit(self, req: Req, kept: int, tok: int, logprobs, accepted: bool, eos_ids: set[int],
                context_length: int) -> None:
        """Keep the first `kept` draft tokens and then `tok`, stopping where the request finishes (a stop
        token or string, max_new_tokens inside the kept run)."""
        tokens = req.draft.tokens[:kept] + [tok]
        self.drop(req)
        computed = req.seq_len + kept  # the forward computed the kept tokens' KV, not the next token's
        for i, t in enumerate(tokens):
            take_token(req, t, *(logprobs[i] if logprobs is not None else (None, None)))
            if i == kept and req.matcher is not None:
                self.force(req, self.grammars.on_token(req, t, eos_ids, context_length, accepted=accepted))
            else:
                req.check_finished(eos_ids, self.tokenizer, context_length)
            if req.finish is not None:
                break
        self.kv.keep_verified(req, computed)

    def stats(self) -> dict:
        spec = self.drafted["speculative"]
        return {
            "tokens_jumped": self.kept["jump_forward"], "tokens_drafted": self.drafted["jump_forward"],
            "spec_algorithm": self.algorithm, "spec_max_draft_tokens": self.max_draft if self.algorithm else None,
            "spec_draft_head": None,
            "spec_verifies": self.spec_verifies, "spec_seeded_verifies": self.seeded_verifies,
            "spec_draft_tokens": spec, "spec_accepted_tokens": self.kept["speculative"],
            "spec_accept_rate": round(self.kept["speculative"] / spec, 4) if spec else None,
            # tokens each verify yields: the kept draft and the model's own next token
            "spec_accept_length": round(1 + self.kept["speculative"] / self.spec_verifies, 4)
            if self.spec_verifies else None,
            # what the measured policy weighs: forwards by rows, draft passes by drafting requests, and the realized
            # tokens a second by running requests, with and without drafts
            "spec_policy": {
                "forward_ms": {r: round(t * 1e3, 1) for r, t in sorted(self.cost.seconds.items())},
                "draft_pass_ms": {r: round(t * 1e3, 1) for r, t in sorted(self.pass_cost.seconds.items())},
                "realized_tok_s": {n: {("drafts" if k else "plain"): round(v.rate, 1) for k, v in rates.items()}
                                   for n, rates in sorted(self.realized.items())},
                "held_back_steps": dict(sorted(self.held_back.items())),
            } if self.drafter is not None else None,
            **(self.drafter.stats() if self.drafter is not None else {}),
        }

