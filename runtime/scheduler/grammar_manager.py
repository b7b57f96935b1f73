"""GrammarManager: the scheduler's constrained-decoding side.

- parks constrained requests until their grammar compiles (worker processes behind an LRU cache),
  failing bad grammars and slow compiles with a 400 (a compile past the timeout has its worker killed);
- samples plain (greedy or temperature) requests without their mask first and fills it only
  where the grammar rejects the pick (exact; most picks pass, so most fills are skipped);
- fills the other requests' token bitmasks on a worker thread while the forward runs;
- advances each request's matcher over its sampled token and plans jump-forward drafts;
- picks the model's constrained tokens over a draft (jump-forward or speculative), which the
  scheduler's SpecManager verifies and commits;
- near max_new_tokens, closes the grammar when the tokens left only just hold its shortest completion
  found (constrained/closing.py), so the output is cut but still parses.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch
from plait.runtime.constrained import GrammarCache, GrammarError, JsonStyle, Matcher, create_backend
from plait.runtime.constrained.base import Lazy
from plait.runtime.constrained.base import token_texts
from plait.runtime.constrained.bitmask import allocate_bitmask, apply_token_bitmask_
from plait.runtime.constrained.closing import (CLOSE_WINDOW, CloseVocab, ClosingMatcher, plan_close,
                                                required_prefixes, still_holds)
from plait.runtime.constrained.compile_worker import IsolatedCompiler, WorkerConfig
from plait.runtime.constrained.jump_forward import allowed_prefix, plan_draft
from plait.runtime.constrained.unique_keys import KeyVocab, UniqueKeys
from plait.runtime.ipc.messages import GRAMMAR_CLOSED, GRAMMAR_CUT, FinishReason
from plait.runtime.narrow_config import NarrowConfig
from plait.runtime.sampling import SampleRow, sample
from plait.runtime.scheduler.faults import fail_request
from plait.runtime.scheduler.req import Req
from plait.runtime.speculative.verify import Pick, walk

logger = logging.getLogger(__name__)

_RETRY_EVERY = 4  # tokens between searches while none has found a completion that fits
# the closing matcher takes over once the tokens left are within twice the longest plan seen (and this
# margin): one token can lengthen the completion by as much as a plan has needed (`}, {` opens another item
# of an array, a tool's name picks a call whose arguments need more than the budget has)
_CLOSE_MARGIN = 4
_SHORT_WINDOW = 48  # the least close_window



@dataclass
class Masks:
    """One step's token bitmasks: each masked request's first row (a drafting request has 1 + len(draft) rows)."""

    bitmask: torch.Tensor
    first: dict[Req, int] = field(default_factory=dict)

    def __contains__(self, req: Req) -> bool:
        return req in self.first

    def rows(self, req: Req, n: int = 1) -> torch.Tensor:
        return self.bitmask[self.first[req] : self.first[req] + n]


def close_window(req: Req) -> int:
    """Tokens before the budget from which the closing keeps a plan: CLOSE_WINDOW (long completions need an
    early start), but no more than half a short request's budget, so speculative guesses (none while a plan
    is kept) still serve its first half."""
    return min(CLOSE_WINDOW, max(_SHORT_WINDOW, req.params.max_new_tokens // 2))


@dataclass(frozen=True)
class GrammarConfig(NarrowConfig):
    model_path: str  # where a compile worker reads the tokenizer (compile_worker.WorkerConfig)
    tokenizer_path: str | None
    grammar_backend: str
    grammar_cache_size: int
    grammar_compile_timeout: float
    json_whitespace: str
    json_key_order: str
    disable_json_narrowing: bool
    disable_jump_forward: bool
    jump_forward_token_budget: int
    disable_grammar_closing: bool


class GrammarManager:
    def __init__(self, args: GrammarConfig, tokenizer, vocab_size: int, eos_ids: list[int]):
        self.args = args
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache = None
        self._pool = self._lazy_close_vocab = None
        if args.grammar_backend != "none":
            if tokenizer is None:
                raise ValueError("a grammar backend needs the tokenizer (drop --skip-tokenizer-init or use "
                                 "--grammar-backend none)")
            # this side of the backend and the closing search's vocabulary walk the whole vocabulary in Python
            # (4.5 s for a 152k one): built when the first grammar needs them, not at start-up, and not on a
            # thread beside the first requests' forwards (which it slowed by seconds, holding the GIL)
            backend = Lazy(lambda: create_backend(args.grammar_backend, tokenizer, vocab_size, eos_ids))
            if not args.disable_grammar_closing:
                self._lazy_close_vocab = Lazy(lambda: CloseVocab.from_tokenizer(tokenizer, vocab_size, eos_ids))
            # compiles run in worker processes: one that outlives --grammar-compile-timeout is killed
            config = WorkerConfig(args.grammar_backend, args.model_path, args.tokenizer_path)
            self.cache = GrammarCache(None, args.grammar_cache_size, new_compiler=lambda: IsolatedCompiler(
                backend, config, args.grammar_compile_timeout))
            # masks are filled while the forward runs: xgrammar releases the GIL, and a CPU forward leaves
            # a core idle in its single-threaded stretches, so the fill costs the step little of its time
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mask")
        self._key_vocab = None  # each token's text and quotes, for JSON schemas' UniqueKeys (built on first use)
        self.closed = 0  # requests whose grammar was closed early (the model would have written on)
        self.close_searches = 0
        self.close_search_s = 0.0
        self.draft_budget = 0  # forced-text draft tokens this step may still add (begin_step)
        self.compiling: list[Req] = []
        self.lazy_fills = 0  # masks filled because an unmasked pick was rejected
        self._faults: list[tuple[Req, Exception]] = []  # mask fills that raised, for the scheduler to fail

    @property
    def _close_vocab(self) -> CloseVocab | None:
        """The closing search's vocabulary (None: closing is off), built on first use."""
        return self._lazy_close_vocab.get() if self._lazy_close_vocab is not None else None

    # ---- compile ---------------------------------------------------------------------------
    def set_budget(self, running: int) -> None:
        """The forced text (jump-forward) the drafts planned after this step's forward may add, in all: the rows
        --jump-forward-token-budget leaves beside the running requests."""
        self.draft_budget = max(0, self.args.jump_forward_token_budget - running)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def submit(self, req: Req, kind: str, text: str) -> None:
        if self.cache is None:
            raise ValueError(f"sampling_params.{kind} needs a grammar backend (the server runs with --grammar-backend none)")
        p = req.params
        style = JsonStyle(p.json_whitespace or self.args.json_whitespace, p.json_key_order or self.args.json_key_order,
                          not self.args.disable_json_narrowing)
        req.constraint.compile = self.cache.get(kind, text, style)
        self.compiling.append(req)

    def poll(self) -> list[Req]:
        """Requests leaving the compile queue: ready, or finished with the reason they failed."""
        out = []
        for req in list(self.compiling):
            fut = req.constraint.compile.future
            if req.finish is not None:
                pass  # aborted while compiling
            elif fut.done():
                err = fut.exception()
                if err is None:
                    compiled = fut.result()
                    c = req.constraint
                    c.matcher, c.backend, c.narrowed = self._matcher(req, compiled), compiled.backend, list(compiled.narrowed)
                else:
                    msg = str(err) if isinstance(err, GrammarError) else f"grammar compile failed: {err!r}"
                    req.end(FinishReason("abort", message=msg, status=400))
            else:  # not done yet: its compile ends by --grammar-compile-timeout (the worker is killed then)
                continue
            self.compiling.remove(req)
            req.constraint.compile = None
            out.append(req)
        return out

    def _matcher(self, req: Req, compiled) -> Matcher:
        """The request's matcher; a JSON schema's also refuses a key its object already holds (unique_keys.py)."""
        matcher = compiled.matcher()
        if req.params.grammar[0] != "json_schema":
            return matcher  # a regex or grammar may hold any text, JSON or not
        if self._key_vocab is None:
            texts = self._close_vocab.texts if self._close_vocab is not None else token_texts(
                self.tokenizer, min(len(self.tokenizer), self.vocab_size))
            self._key_vocab = KeyVocab.from_texts(tuple(texts))
        return UniqueKeys(matcher, self._key_vocab)

    def wait(self, timeout: float = 0.005) -> None:
        wait_futures([r.constraint.compile.future for r in self.compiling], timeout=timeout, return_when="FIRST_COMPLETED")

    # ---- masks -----------------------------------------------------------------------------
    def start_masks(self, sampling: list[Req]) -> Future | None:
        """Fill the masks of the constrained requests among `sampling` on the worker thread (the
        forward runs meanwhile). A drafting request gets one row per draft position, its
        matcher stepping through the draft; `verify` rolls back what the model rejects."""
        reqs = [r for r in sampling if r.matcher is not None and not self.lazy(r)]
        if not reqs:
            return None

        def fill() -> Masks:
            first, n = {}, 0
            for r in reqs:
                first[r] = n
                n += 1 + len(r.draft.tokens)
            bitmask = allocate_bitmask(n, self.vocab_size)
            for r in reqs:
                row = first[r]
                try:
                    r.matcher.fill_bitmask(bitmask, row)
                    for i, t in enumerate(r.draft.tokens):
                        r.matcher.accept_token(t)  # checked when the draft was planned
                        r.matcher.fill_bitmask(bitmask, row + 1 + i)
                except Exception as e:  # noqa: BLE001 - fails this request alone (the scheduler reports it)
                    self._faults.append((r, e))
            return Masks(bitmask, first)

        return self._pool.submit(fill)

    def take_faults(self) -> list[tuple[Req, Exception]]:
        """(request, exception) for each mask fill that raised in the last `start_masks` (call after its result)."""
        faults, self._faults = self._faults, []
        return faults

    @staticmethod
    def lazy(req: Req) -> bool:
        """Sample without the mask first, and mask only if the grammar rejects the pick? Exact for a
        greedy or plain temperature draw: a rejected draw followed by a masked draw picks each allowed
        token with its probability renormalised over the allowed set, as the masked draw alone does.
        Drafts are verified the same way, position by position. Not for top-k/p or min-p (the cut
        depends on the mask) nor logprobs (reported masked)."""
        p = req.params
        return not req.return_logprob and p.top_k == -1 and p.top_p == 1 and p.min_p == 0

    def settle(self, logits: torch.Tensor, reqs: list[Req], rows: list[SampleRow], next_ids: list[int],
               masks: Masks | None) -> set[int]:
        """Advance the matchers of the lazily masked requests over their unmasked picks; where the
        grammar rejects one, fill that mask now and sample the row again. Returns the indices whose
        token the matcher has accepted (on_token then skips accepting it). A request whose matcher
        raises fails alone (faults.py) and the others go on."""
        accepted = set()
        for k, req in enumerate(reqs):
            if req.matcher is None or (masks is not None and req in masks) or req.finish is not None:
                continue
            try:
                if not req.matcher.accept_token(next_ids[k]):
                    next_ids[k] = self._masked_pick(req, logits[k : k + 1], rows[k])
                    if not req.matcher.accept_token(next_ids[k]):
                        continue  # unreachable (the mask allows it); on_token reports it
            except Exception as e:  # noqa: BLE001
                fail_request(req, "advancing its grammar", e)
                continue
            accepted.add(k)
        return accepted

    @staticmethod
    def apply(logits: torch.Tensor, reqs: list[Req], masks: Masks) -> None:
        """Mask the rows of `logits` (row k belongs to reqs[k]) in one op."""
        ks = [k for k, r in enumerate(reqs) if r in masks]
        if not ks:
            return
        sub = logits[ks]
        apply_token_bitmask_(sub, masks.bitmask[[masks.first[reqs[k]] for k in ks]])
        logits[ks] = sub

    # ---- tokens ----------------------------------------------------------------------------
    def on_token(self, req: Req, tok: int, eos_ids: set[int], context_length: int, accepted: bool = False
                 ) -> list[int]:
        """Advance the matcher over a sampled token (unless `accepted` says settle did); finish, or return the
        forced text that follows (jump-forward: the draft SpecManager sets for the next forward; [] if none)."""
        if not accepted and not req.matcher.accept_token(tok):  # unreachable; never emit invalid output
            req.end(FinishReason("abort", message=f"the grammar rejected token {tok}"))
            return []
        if req.matcher.is_terminated():
            req.end(FinishReason("stop", matched=tok))
        else:
            req.check_finished(eos_ids, self.tokenizer, context_length)
        if req.finish is not None:
            closing = req.matcher if req.constraint.closing else None
            if closing is not None:
                self.close_searches += closing.searches
                self.close_search_s += closing.search_s
            if closing is not None and closing.cut:
                self.closed += 1
                req.end(FinishReason("length", message=GRAMMAR_CLOSED))
            elif req.finish.type == "length":
                req.end(FinishReason("length", message=GRAMMAR_CUT))
            return []
        left = min(req.params.max_new_tokens - req.output_len, context_length - req.seq_len)
        reserve = self._close_if_due(req, left)
        if self.args.disable_jump_forward or req.return_logprob or req.params.has_penalties:
            return []  # logprobs and penalties are per sampled token: no drafts for them
        # leave room for the token sampled after the draft, and for the closing
        room = left - 1 - reserve
        draft = plan_draft(req.matcher, self.tokenizer, min(room, self.draft_budget))
        self.draft_budget -= len(draft)
        return draft

    def _close_if_due(self, req: Req, left: int) -> int:
        """Within close_window() tokens of the budget, keep a planned completion of the grammar: the last one
        while it still takes the grammar to its end, else a new search (every few tokens while none fits).
        Once the tokens left come within twice the longest plan yet, the request's matcher
        becomes a ClosingMatcher (the model writes on only while a completion still fits). Returns the
        tokens a draft must leave."""
        c = req.constraint
        if self._close_vocab is None or c.closing or left > close_window(req):
            return 0
        last = c.close_plan
        start = time.perf_counter()
        if last is not None and len(last) <= left - 2 and still_holds(c.matcher, last, self._close_vocab):
            plan = last  # the model wrote on inside what the plan closes: no new search
        elif last is None and c.close_retry_left is not None and left > c.close_retry_left:
            return 0  # nothing fitted a few tokens ago: not searched again yet
        else:
            if c.close_required is None:
                c.close_required = required_prefixes(req.params.json_schema)
            plan = plan_close(c.matcher, self._close_vocab, self.tokenizer.decode(req.output_ids), left - 2,
                              c.close_required)
            self.close_searches += 1
            c.close_retry_left = left - _RETRY_EVERY if plan is None else None
        self.close_search_s += time.perf_counter() - start
        c.close_plan = plan
        if plan is None:
            return 0
        c.close_longest = max(c.close_longest, len(plan))
        if left <= 2 * c.close_longest + _CLOSE_MARGIN:
            c.matcher = ClosingMatcher(c.matcher, plan, self._close_vocab, self.tokenizer.decode(req.output_ids),
                                       left, c.close_required or frozenset())
            c.closing = True
            return 0
        return c.close_longest + 1

    def pick_verified(self, req: Req, rows: torch.Tensor, masks: Masks | None) -> tuple[int, int, bool]:
        """The model's constrained picks over a draft (rows: logits at the last sampled token and at each
        draft position). Returns (draft tokens kept, the token after them, whether the matcher has
        accepted that token); the matcher has accepted the kept draft tokens."""
        draft = req.draft.tokens
        sr = SampleRow(req.params, req.generator, req.output_ids, req.origin_input_ids, [], False, 0)
        if masks is None or req not in masks:
            path, tok = walk(draft, None, self._lazy_picks(req, rows, sr))
            return len(path), tok, True
        rows = rows.clone()
        apply_token_bitmask_(rows, masks.rows(req, len(rows)))
        chosen = rows.argmax(-1).tolist() if req.params.is_greedy else None
        # one draw per position the walk reaches, as decoding draws one per emitted token
        path, tok = walk(draft, None, lambda node, _: chosen[node + 1] if chosen is not None
                         else sample(rows[node + 1 : node + 2], [sr]).next_ids[0])
        req.matcher.rollback(len(draft) - len(path))  # the mask fill stepped through the whole draft
        return len(path), tok, False

    def admissible(self, req: Req, guess: list[int]) -> list[int]:
        """The longest prefix of a speculative guess the request's grammar allows after its draft so far (the
        forced text, if any; matcher unchanged), short of the grammar's end."""
        if req.constraint.closing or req.constraint.close_plan is not None:
            # near the budget the closing plans the end: no guesses. Their tokens would be committed together,
            # and the closing's state (its plans, when it takes over) would follow other steps than decoding
            # token by token does, and so might its masks: outputs must not depend on drafts
            return []
        for t in req.draft.tokens:
            req.matcher.accept_token(t)  # checked when the forced text was planned
        n = allowed_prefix(req.matcher, guess, before_end=True)
        req.matcher.rollback(len(req.draft.tokens))
        return guess[:n]

    def _masked_pick(self, req: Req, row: torch.Tensor, sr: SampleRow) -> int:
        """Sample the logits row [1, vocab] again under the mask of the matcher's current state (the
        unmasked pick was refused)."""
        bitmask = allocate_bitmask(1, self.vocab_size)
        req.matcher.fill_bitmask(bitmask, 0)
        row = row.clone()
        apply_token_bitmask_(row, bitmask)
        self.lazy_fills += 1
        return sample(row, [sr]).next_ids[0]

    def _lazy_picks(self, req: Req, rows: torch.Tensor, sr: SampleRow) -> Pick:
        """Picks over a draft as `settle` makes them (unmasked first, the mask only on rejection); the matcher
        accepts each pick, so it ends having accepted the kept draft and the final pick."""
        def pick(node: int, _path: list[int]) -> int:
            row = rows[node + 1 : node + 2]
            tok = sample(row, [sr]).next_ids[0]
            if not req.matcher.accept_token(tok):
                tok = self._masked_pick(req, row, sr)
                req.matcher.accept_token(tok)  # allowed by the mask
            return tok
        return pick

    def stats(self) -> dict:
        return {"num_compiling": len(self.compiling),
                "grammars_closed": self.closed,
                "close_searches": self.close_searches, "close_search_s": round(self.close_search_s, 3), "lazy_mask_fills": self.lazy_fills,
                "grammar_cache_hits": self.cache.hits if self.cache else 0,
                "grammar_cache_misses": self.cache.misses if self.cache else 0}
