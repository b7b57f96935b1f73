"""Scheduler: continuous batching around a short loop.

    step: admit (radix match, budgets) -> build batch -> forward -> sample -> commit to cache -> emit

Every running request decodes one token per step; waiting requests are admitted as prefill
chunks into the same forward under a token budget (`max_prefill_tokens`, `chunked_prefill_size`).
When KV runs out, the cache is evicted first, then the newest running requests are retracted to
the waiting queue (their computed tokens stay cached) and resume later.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from plait.radix_cache.radix_cache import common_prefix_len
from plait.runtime.constrained import GrammarError
from plait.runtime.managers.io_struct import (AbortReq, DecodeSpec, FinishReason, JoinKVReq, TokenizedGenerateReq,
                                             TokenOut)
from plait.runtime.managers.limits import RuntimeLimits, validate_request
from plait.runtime.model_executor.forward_batch import ForwardMode
from plait.runtime.model_executor.model_runner import ModelRunner, WorkItem
from plait.runtime.sampling import SampleRow, sample
from plait.runtime.sampling.sampler import SampleResult
from plait.runtime.scheduler.grammar_manager import GrammarManager, Masks
from plait.runtime.scheduler.kv_manager import KVManager
from plait.runtime.scheduler.policy import fair_order, order_waiting
from plait.runtime.scheduler.req import Req
from plait.runtime.scheduler.spec_manager import SpecManager
from plait.runtime.server_args import ServerArgs
from plait.runtime.speculative.drafter import build_drafter

logger = logging.getLogger(__name__)

# admission reserves this share of each request's remaining decode budget; it decays while
# nothing is retracted and jumps back up after a retraction (SGLang's new_token_ratio)
_RATIO_INIT, _RATIO_MIN, _RATIO_DECAY = 0.7, 0.1, 0.002
# a waiting request sharing at least this many more tokens with one admitted in the same step
# than with the cache waits one step, so it reuses that one's prefix instead of recomputing it
_IN_BATCH_SHARE = 32


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner, emit: Callable[[list[TokenOut]], None]):
        self.args = args
        self.runner = runner
        self.emit = emit
        self.tokenizer = runner.tokenizer
        self.kv = KVManager(runner.allocator, runner.req_to_token, not args.disable_radix_cache, runner.kv_window)
        self.context_length = runner.context_length
        eos = set(runner.config.eos_token_ids)
        if runner.tokenizer is not None and runner.tokenizer.eos_token_id is not None:
            eos.add(runner.tokenizer.eos_token_id)
        self.eos_ids = eos
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # admitted, holding KV (prefilling or decoding)
        self.new_token_ratio = _RATIO_INIT
        self._seed_counter = args.random_seed
        self.num_retracted = 0
        self.num_failed = 0  # requests ended by a fault of their own (status 500)
        self.num_kv_joins = 0
        self.forward_passes = 0
        self.tokens_generated = 0
        self.grammars = GrammarManager(args, self.tokenizer, runner.config.vocab_size, sorted(eos))
        self.spec = SpecManager(args, self.tokenizer, self.grammars, build_drafter(args, runner),
                                runner.req_to_token.table)
        self.limits = RuntimeLimits(self.context_length, runner.allocator.capacity, runner.config.vocab_size,
                                    sum(p.numel() * p.element_size() for p in runner.model.parameters()))

    # ---- requests in ----------------------------------------------------------------
    def add_request(self, msg: TokenizedGenerateReq) -> None:
        validate_request(msg, self.limits)
        self._seed_counter += 1
        req = Req(msg, self._seed_counter)
        spec = req.params.grammar
        if spec is None:
            self.waiting.append(req)
        else:  # parked until its grammar compiles
            self.grammars.submit(req, *spec)

    def abort(self, msg: AbortReq) -> None:
        for queue in (self.grammars.compiling, self.waiting, self.running):
            for req in queue:
                if req.rid == msg.rid and req.finish is None:
                    req.finish = FinishReason("abort", message="aborted")
        if self.grammars.compiling:
            self.waiting.extend(self.grammars.poll())  # takes out the ones aborted while compiling
        self._reap()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.grammars.compiling

    def close(self) -> None:
        """Stop the grammar compile workers (the process's end stops them too)."""
        self.grammars.close()

    # ---- the loop body --------------------------------------------------------------
    def step(self) -> bool:
        """Run one forward if there is work. Returns False when idle."""
        if self.idle:
            return False
        if self.grammars.compiling:
            self.waiting.extend(self.grammars.poll())
            self._reap()  # reports the ones whose grammar failed
        decoding = self._reserve_decode()
        prefill = self._admit(budget=self.args.max_prefill_tokens - len(decoding))
        batch = prefill + decoding
        if not batch:
            if self.waiting or self.running:
                self._unstick()
            elif self.grammars.compiling:  # nothing to run until a grammar is ready
                self.grammars.wait()
            return not self.idle
        items = [self._work_item(req, n, i >= len(prefill)) for i, (req, n) in enumerate(batch)]
        masks = self.grammars.start_masks([r for r, n in batch if r.cached_len + n == r.seq_len])
        features = None
        speculative = any(r.guess_len for r, _ in batch)
        tokens_before = self.tokens_generated
        start = time.perf_counter()
        if self.spec.capture:  # the draft head reads the target's features at every committed position
            logits, features = self.runner.forward(items, self.spec.capture)
        else:
            logits = self.runner.forward(items)
        decoding_only = all(it.mode is not ForwardMode.EXTEND for it in items)
        if decoding_only:  # what drafts are weighed against
            self.spec.record_forward(sum(len(it.tokens) for it in items), time.perf_counter() - start)
        self.forward_passes += 1
        # drafts pay while a forward is bandwidth-bound: keep the next one within the token budgets
        self.spec.begin_step(len(self.running), len(self.waiting))
        self._process(batch, items, logits, masks, features)
        if decoding_only:
            self.spec.record_step(len(items), speculative, self.tokens_generated - tokens_before,
                                  time.perf_counter() - start)
        self.new_token_ratio = max(_RATIO_MIN, self.new_token_ratio - _RATIO_DECAY)
        return True

    # ---- admission and memory --------------------------------------------------------
    def _reserve_decode(self) -> list[tuple[Req, int]]:
        """One slot for every decoding request, retracting the newest ones while short."""
        decoding = [r for r in self.running if r.pending_len == 1]
        out = []
        while decoding:
            req = decoding.pop(0)
            while not self.kv.reserve(req, 1):
                victim = self._pick_victim(exclude=req)
                if victim is None:  # nothing left to retract: this request cannot grow
                    req.finish = FinishReason("length", message="KV cache is full")
                    break
                if victim in decoding:
                    decoding.remove(victim)
                out = [(r, n) for r, n in out if r is not victim]
                self._retract(victim)
            if req.finish is None:
                out.append((req, 1))
        self._reap()
        return out

    def _pick_victim(self, exclude: Req) -> Req | None:
        candidates = [r for r in self.running if r is not exclude and r.finish is None]
        return candidates[-1] if candidates else None

    def _retract(self, req: Req) -> None:
        req.drop_draft()
        self.kv.release(req)  # its computed tokens stay in the cache: resuming is cheap
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.num_retracted += 1
        req.num_retractions += 1
        self.new_token_ratio = _RATIO_INIT
        logger.debug("retracted %s at %d tokens", req.rid, req.seq_len)

    def _admit(self, budget: int) -> list[tuple[Req, int]]:
        """Prefill chunks for requests already prefilling, then for newly admitted ones."""
        chunk_cap = self.args.chunked_prefill_size if self.args.chunked_prefill_size > 0 else 1 << 30
        out: list[tuple[Req, int]] = []
        for req in self.running:  # continue chunked prefills first
            if req.pending_len > 1 and budget > 0:
                n = min(req.pending_len, chunk_cap, budget)
                if req.draft and n < req.pending_len:
                    continue  # a draft is verified in one forward
                if not self.kv.reserve(req, n):
                    break
                out.append((req, n))
                budget -= n
        if budget <= 0 or not self.waiting:
            return out

        ordered = fair_order(order_waiting(self.waiting, self.args.schedule_policy, self.kv), self.running)
        reserved = sum(min(r.remaining_tokens(), 4096) for r in self.running) * self.new_token_ratio
        admitted: list[Req] = []
        prefilling = [r for r in self.running if r.pending_len > 1]  # their prefixes reach the cache soon
        for req in ordered:
            if budget <= 0 or len(self.running) >= self.args.max_running_requests:
                break
            cached = self.kv.match_len(req)
            if (admitted or prefilling) and self._should_wait_for_sibling(req, cached, admitted + prefilling):
                continue
            n = min(req.seq_len - cached, chunk_cap, budget)
            future = min(req.remaining_tokens(), 4096) * self.new_token_ratio
            if self.kv.available() - reserved < n + future and self.running:
                break  # keep room for what running requests will still generate
            if self.kv.window_room() < n + self.kv.window and self.running:
                break
            if not self.kv.admit(req):
                break
            n = min(req.pending_len, chunk_cap, budget)
            if not self.kv.reserve(req, n):
                self.kv.release(req)
                break
            self.waiting.remove(req)
            self.running.append(req)
            if req.queue_time is None:  # first admission (a retracted request keeps its first wait)
                req.queue_time = time.perf_counter() - req.arrival
            admitted.append(req)
            out.append((req, n))
            budget -= n
            reserved += future
        return out

    def _should_wait_for_sibling(self, req: Req, cached: int, siblings: list[Req]) -> bool:
        shared = max(common_prefix_len(req.fill_ids, other.fill_ids) for other in siblings)
        return shared - cached >= _IN_BATCH_SHARE

    def _unstick(self) -> None:
        """No batch could be formed: free memory by retracting, or fail what can never run."""
        if len(self.running) > 1:
            self._retract(self.running[-1])
            return
        req = self.running[0] if self.running else self.waiting[0]
        req.finish = FinishReason("abort", message="request does not fit the KV cache")
        self._reap()

    # ---- forward inputs and outputs ---------------------------------------------------
    def _work_item(self, req: Req, n: int, decoding: bool) -> WorkItem:
        start = req.cached_len
        tokens = req.fill_ids[start : start + n]
        offsets: list[int] = []
        lp_start = req.input_logprob_start()
        if lp_start < req.prompt_len:
            # logits at position p score prompt token p+1
            lo, hi = max(lp_start, 1) - 1, req.prompt_len - 1
            offsets = [p - start for p in range(max(lo, start), min(hi, start + n))]
        if start + n == req.seq_len:  # logits at the last token, and at each draft token before it
            offsets.extend(range(n - 1 - len(req.draft), n))
        mode = ForwardMode.TARGET_VERIFY if req.draft else (ForwardMode.DECODE if decoding else ForwardMode.EXTEND)
        return WorkItem(req.row, start, tokens, offsets, mode, req.draft_parents if req.draft else None)

    def _process(self, batch: list[tuple[Req, int]], items: list[WorkItem], logits: torch.Tensor,
                 masks: Future | None, features: list[torch.Tensor] | None = None) -> None:
        to_sample: list[tuple[Req, int]] = []
        to_verify: list[tuple[Req, int]] = []
        row = 0
        for (req, n), item in zip(batch, items):
            nrows = len(item.logit_offsets)
            req.cached_len += n
            if req.input_logprob_start() < req.prompt_len:
                with self._isolated(req, "computing its prompt logprobs"):
                    self._record_input_logprobs(req, item, logits[row : row + nrows])
            if req.cached_len == req.seq_len:
                if req.params.max_new_tokens == 0:
                    req.finish = FinishReason("length")  # prefill-only: the prompt is now cached
                elif req.draft:
                    to_verify.append((req, row + nrows - 1 - len(req.draft)))
                else:
                    to_sample.append((req, row + nrows - 1))
            if n > 1 and not req.draft:
                self.kv.cache_prefix(req)  # siblings waiting on this prefix can share it now
            row += nrows
        mask_rows = masks.result() if masks is not None else None
        for req, e in self.grammars.take_faults():  # a mask fill that raised
            self._fail_request(req, "filling its grammar mask", e)
        to_sample = [(r, i) for r, i in to_sample if r.finish is None]
        to_verify = [(r, i) for r, i in to_verify if r.finish is None]
        took: list[Req] = []  # requests that took tokens: they may draft for the next forward
        if to_sample:
            took += self._sample(to_sample, logits, mask_rows)
        for req, first in to_verify:
            before = req.output_len - len(req.draft)
            with self._isolated(req, "verifying its draft"):
                self.spec.verify(req, logits[first : first + len(req.draft) + 1], mask_rows, self.eos_ids,
                                 self.context_length)
                # a forced draft planned for the next forward is in output_ids already: not generated yet
                self.tokens_generated += req.output_len - len(req.draft) - before
                self.kv.cache_prefix(req)  # only tokens the model confirmed
                took.append(req)
        try:
            self.spec.plan(took, batch, items, features, self.context_length)
        except Exception:  # noqa: BLE001 - drafts only save time: a fault planning them costs this step its drafts
            logger.exception("planning speculative drafts failed; this step drafts nothing")
            for req in took:
                req.drop_draft(guess_only=True)
        self._reap()

    # ---- faults of one request --------------------------------------------------------
    @contextmanager
    def _isolated(self, req: Req, what: str) -> Iterator[None]:
        """Run per-request work; an exception fails that request alone (status 500, traceback
        logged) and leaves the batch, the cache and every other request intact."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any bug in one request's handling is that request's failure
            self._fail_request(req, what, e)

    def _fail_request(self, req: Req, what: str, e: BaseException) -> None:
        req.drop_draft()
        req.cached_len = min(req.cached_len, req.seq_len)
        if isinstance(e, GrammarError):  # the client's grammar ran into a backend's limit: a 400
            logger.warning("request %s failed while %s: %s", req.rid, what, e)
            req.finish = FinishReason("abort", status=400, message=f"the grammar failed while {what}: {e}")
        else:
            logger.error("request %s failed while %s", req.rid, what, exc_info=e)
            req.finish = FinishReason("abort", status=500,
                                      message=f"internal error while {what}: {type(e).__name__}: {e}")
        self.num_failed += 1

    def _record_input_logprobs(self, req: Req, item: WorkItem, rows: torch.Tensor) -> None:
        start = item.cached_len
        if start == 0 and req.input_logprob_start() == 0:
            req.pending_input_logprobs.append((None, req.origin_input_ids[0]))  # nothing scores token 0
            req.pending_input_top.append(None)
        scored = [(i, start + off + 1) for i, off in enumerate(item.logit_offsets) if start + off + 1 < req.prompt_len]
        if scored:
            lps = torch.log_softmax(rows[[i for i, _ in scored]], dim=-1)
            for k, (_, pos) in enumerate(scored):
                tok = req.origin_input_ids[pos]
                req.pending_input_logprobs.append((float(lps[k, tok]), tok))
                top = None
                if req.top_logprobs_num:
                    v, ix = torch.topk(lps[k], req.top_logprobs_num)
                    top = list(zip(v.tolist(), ix.tolist()))
                req.pending_input_top.append(top)
        if req.cached_len >= req.prompt_len:
            req.input_logprobs_done = True

    def _sample(self, to_sample: list[tuple[Req, int]], logits: torch.Tensor,
                masks: Masks | None) -> list[Req]:
        """Sample each request's next token; returns the requests that took one."""
        rows = []
        for req, _ in to_sample:
            p = req.params
            banned = []
            if req.output_len < p.min_new_tokens and req.grammar is None:  # a grammar decides where it ends
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_ids))
            rows.append(SampleRow(p, req.generator, req.output_ids, req.origin_input_ids, banned,
                                  req.return_logprob, req.top_logprobs_num if req.return_logprob else 0))
        selected = logits[[i for _, i in to_sample]]
        reqs = [req for req, _ in to_sample]
        if masks is not None:
            self.grammars.apply(selected, reqs, masks)
        result = self._sample_isolated(selected, rows, reqs)
        settled = self.grammars.settle(selected, reqs, rows, result.next_ids, masks, self._fail_request)
        took = []
        for k, (req, _) in enumerate(to_sample):
            if req.finish is not None:  # failed while sampling or settling
                continue
            with self._isolated(req, "taking its sampled token"):
                self._take_token(req, k, result, k in settled)
                took.append(req)
        return took

    def _sample_isolated(self, logits: torch.Tensor, rows: list[SampleRow], reqs: list[Req]) -> SampleResult:
        """One batched sample; if it raises, sample row by row to find the culprit and fail only it
        (each row draws from its own generator, so the others pick what the batch would have)."""
        try:
            return sample(logits, rows)
        except Exception:  # noqa: BLE001
            pass
        ids, lps, tops = [], [], []
        want = any(r.want_logprob for r in rows)
        for k, (row, req) in enumerate(zip(rows, reqs)):
            try:
                one = sample(logits[k : k + 1], [row])
            except Exception as e:  # noqa: BLE001
                self._fail_request(req, "sampling", e)
                one = SampleResult([0], [0.0] if want else None, [([], [])] if want else None)
            ids.append(one.next_ids[0])
            lps.append(one.logprobs[0] if one.logprobs else 0.0)
            tops.append(one.top_logprobs[0] if one.top_logprobs else ([], []))
        return SampleResult(ids, lps if want else None, tops if want else None)

    def _take_token(self, req: Req, k: int, result: SampleResult, accepted: bool) -> None:
        tok = result.next_ids[k]
        req.output_ids.append(tok)
        self.tokens_generated += 1
        req.pending_ids.append(tok)
        if result.logprobs is not None and req.return_logprob:
            req.pending_logprobs.append((result.logprobs[k], tok))
            if result.top_logprobs is not None and req.top_logprobs_num:
                vals, ids = result.top_logprobs[k]
                req.pending_top.append(list(zip(vals, ids)))
        if req.grammar is not None:
            self.grammars.on_token(req, tok, self.eos_ids, self.context_length, accepted=accepted)
        else:
            req.check_finished(self.eos_ids, self.tokenizer, self.context_length)

    def _reap(self) -> None:
        """Emit progress; release finished requests."""
        outs = []
        for req in list(self.running):
            if req.pending_ids or req.finish is not None or req.pending_input_logprobs:
                outs.append(self._out(req))
            if req.finish is not None:
                self.kv.release(req)
                self.spec.release(req)
                self.running.remove(req)
        for req in [r for r in self.waiting if r.finish is not None]:
            self.waiting.remove(req)
            self.kv.release(req)
            self.spec.release(req)
            outs.append(self._out(req))
        if outs:
            self.emit(outs)

    def _out(self, req: Req) -> TokenOut:
        p = req.params
        out = TokenOut(
            rid=req.rid,
            new_ids=req.pending_ids,
            finish=req.finish,
            prompt_tokens=req.prompt_len,
            completion_tokens=req.output_len,
            cached_tokens=max(req.cached_tokens, 0),
            output_logprobs=req.pending_logprobs,
            output_top_logprobs=req.pending_top,
            input_logprobs=req.pending_input_logprobs,
            input_top_logprobs=req.pending_input_top,
            queue_time=None if req.queue_time_sent else req.queue_time,
            num_retractions=req.num_retractions,
            grammar_backend=req.grammar_backend,
            grammar_narrowed=[] if req.decode_sent else req.grammar_narrowed,
            spec_verify_ct=req.spec_verify_ct,
            spec_drafted=req.spec_drafted,
            spec_accepted=req.spec_accepted,
            decode=None if req.decode_sent else DecodeSpec(p.stop, p.skip_special_tokens, p.no_stop_trim,
                                                           p.spaces_between_special_tokens),
        )
        req.decode_sent = True
        req.queue_time_sent = req.queue_time_sent or req.queue_time is not None
        req.pending_ids, req.pending_logprobs, req.pending_top = [], [], []
        req.pending_input_logprobs, req.pending_input_top = [], []
        return out

    def join_kv(self, msg: JoinKVReq) -> dict:
        """concate_and_append (KVManager.join): {"join_id", "input_ids", "reused"} or {"reason"}."""
        if len(msg.parts) < 2 or any(len(p) > self.context_length for p in msg.parts):
            return {"reason": "a join needs two or more parts within the context length"}
        if sum(len(p) - msg.fork_len for p in msg.parts) + msg.fork_len > self.context_length:
            return {"reason": "the joined text is longer than the context length"}
        join_id = msg.req_id
        res = self.kv.join(msg.parts, msg.fork_len, tuple(msg.kv_joins), join_id, self._copy_kv)
        if not res.ok:
            return {"reason": res.reason}
        self.num_kv_joins += 1
        return {"join_id": join_id, "input_ids": res.input_ids, "reused": res.reused}

    def _copy_kv(self, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor) -> None:
        self.runner.copy_kv(src, dst, shift)
        self.spec.copy_kv(src, dst, shift)

    # ---- introspection --------------------------------------------------------------
    def flush_cache(self) -> bool:
        if not (self.idle and self.kv.flush()):
            return False
        self.spec.flush()
        return True

    def stats(self, check: bool = False) -> dict:
        cache = self.kv.cache.stats()
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_capacity": self.runner.allocator.capacity,
            "kv_free": self.runner.allocator.free_slots,
            "kv_bytes": self.runner.kv_pool.nbytes,
            # the sliding-window layers' slots (0 when they keep every token's KV)
            "kv_window_capacity": self.runner.allocator.window.capacity if self.kv.window else 0,
            "kv_window_free": self.runner.allocator.window.free_slots if self.kv.window else 0,
            "cache_tokens": cache.total_tokens,
            "cache_evictable": cache.evictable_tokens,
            "cache_protected": cache.protected_tokens,
            "cache_hit_rate": cache.hit_rate,
            "dtype": self.args.dtype,
            "kernels": self.runner.kernels,
            "weight_formats": self.runner.weight_formats,
            # decode steps of few rows run the layer stack as one C call (kernels/cpu_decode.py), else the loop
            "decode_stack": self.runner.model.graph.name if self.runner.model.graph is not None else "loop",
            "num_retracted": self.num_retracted,
            "num_failed": self.num_failed,
            "num_kv_joins": self.num_kv_joins,
            # the KV accounting checked end to end, when nothing runs (None while busy)
            "kv_check": (self.kv.check() or "ok") if check and self.idle else None,
            "forward_passes": self.forward_passes,
            "tokens_generated": self.tokens_generated,
            **self.grammars.stats(),
            **self.spec.stats(),
        }
