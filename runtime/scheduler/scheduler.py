"""Scheduler: continuous batching around a short loop of small managers.

    step: admit -> forward -> sample -> commit -> emit

Admission (admission.py) picks the next forward's work: one token for every decoding request and prefill
chunks for waiting ones under a token budget, retracting the newest requests when KV runs out. KV and the
radix cache are KVManager's, grammars GrammarManager's, drafts and their verification SpecManager's.
A fault in one request fails it alone (faults.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Callable

import torch
from plait.runtime.forward.batch import ForwardMode
from plait.runtime.ipc.limits import RuntimeLimits, validate_request
from plait.runtime.ipc.messages import AbortReq, FinishReason, JoinKVReq, TokenizedGenerateReq, TokenOut
from plait.runtime.model_executor.model_runner import ModelRunner, WorkItem
from plait.runtime.model_loader.tokenizer import end_ids
from plait.runtime.sampling.sampler import SampleResult
from plait.runtime.scheduler.admission import Admission, AdmissionConfig, Batch
from plait.runtime.scheduler.batch_sampler import sample_isolated, sample_rows
from plait.runtime.scheduler.faults import fail_request, isolated
from plait.runtime.scheduler.grammar_manager import GrammarConfig, GrammarManager, Masks
from plait.runtime.scheduler.kv_manager import KVManager
from plait.runtime.scheduler.req import Req
from plait.runtime.scheduler.req_io import has_news, record_input_logprobs, token_out, work_item
from plait.runtime.scheduler.spec_manager import SpecManager
from plait.runtime.server_args import ServerArgs
from plait.runtime.speculative.config import DraftConfig
from plait.runtime.speculative.drafter import build_drafter


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner, emit: Callable[[list[TokenOut]], None]):
        self.args = args
        self.runner = runner
        self.emit = emit
        self.tokenizer = runner.tokenizer
        self.kv = KVManager(runner.allocator, runner.req_to_token, not args.disable_radix_cache, runner.kv_window)
        self.admission = Admission(AdmissionConfig.of(args), self.kv)
        self.context_length = runner.context_length
        self.eos_ids = set(end_ids(runner.config, runner.tokenizer))
        self._seed_counter = args.random_seed
        self.num_failed = 0  # requests ended by a fault of their own (status 500, or 400 for a grammar's limit)
        self.num_kv_joins = 0
        self.forward_passes = 0
        self.tokens_generated = 0
        self.grammars = GrammarManager(GrammarConfig.of(args), self.tokenizer, runner.config.vocab_size, sorted(self.eos_ids))
        drafts = DraftConfig.of(args)
        self.speculation = SpecManager(drafts, self.tokenizer, self.grammars, build_drafter(drafts, runner),
                                runner.req_to_token.table)
        self.limits = RuntimeLimits(self.context_length, runner.allocator.capacity, runner.config.vocab_size,
                                    sum(p.numel() * p.element_size() for p in runner.model.parameters()))

    @property
    def waiting(self) -> list[Req]:
        return self.admission.waiting

    @property
    def running(self) -> list[Req]:
        return self.admission.running

    # ---- requests in ----------------------------------------------------------------
    def add_request(self, msg: TokenizedGenerateReq) -> None:
        validate_request(msg, self.limits)
        self._seed_counter += 1
        req = Req(msg, self._seed_counter)
        if req.params.grammar is None:
            self.waiting.append(req)
        else:  # parked until its grammar compiles
            self.grammars.submit(req, *req.params.grammar)

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
        """admit -> forward -> sample -> commit -> emit, if there is work. Returns False when idle."""
        if self.idle:
            return False
        if self.grammars.compiling:
            self.waiting.extend(self.grammars.poll())
            self._reap()  # reports the ones whose grammar failed
        decoding = self.admission.reserve_decode()
        self._reap()  # those that could not grow
        batch = self.admission.admit(self.args.max_prefill_tokens - len(decoding)) + decoding
        if not batch:
            return self._wait()
        items = [work_item(req, n, i >= len(batch) - len(decoding)) for i, (req, n) in enumerate(batch)]
        masks = self.grammars.start_masks([r for r, n in batch if r.cached_len + n == r.seq_len])
        speculative = any(r.guess_len for r, _ in batch)
        tokens_before, start = self.tokens_generated, time.perf_counter()
        logits, features = self._forward(items)
        decoding_only = all(it.mode is not ForwardMode.EXTEND for it in items)
        if decoding_only:  # what drafts are weighed against
            self.speculation.record_forward(sum(len(it.tokens) for it in items), time.perf_counter() - start)
        # drafts pay while a forward is bandwidth-bound: keep the next one within the token budgets
        self.speculation.begin_step(len(self.running), len(self.waiting))
        self.grammars.begin_step(len(self.running))
        self._process(batch, items, logits, masks, features)
        if decoding_only:
            self.speculation.record_step(len(items), speculative, self.tokens_generated - tokens_before,
                                  time.perf_counter() - start)
        self.admission.stepped()
        return True

    def _wait(self) -> bool:
        """No forward could be formed: unstick the queues, or wait for a grammar."""
        if self.waiting or self.running:
            self.admission.stuck()
            self._reap()
        elif self.grammars.compiling:  # nothing to run until a grammar is ready
            self.grammars.wait()
        return not self.idle

    def _forward(self, items: list[WorkItem]) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        self.forward_passes += 1
        if self.speculation.capture:  # the draft head reads the target's features at every committed position
            return self.runner.forward(items, self.speculation.capture)
        return self.runner.forward(items), None

    # ---- commit: what the forward computed ----------------------------------------------
    def _process(self, batch: Batch, items: list[WorkItem], logits: torch.Tensor,
                 masks: Future | None, features: list[torch.Tensor] | None = None) -> None:
        to_sample, to_verify = self._commit(batch, items, logits)
        mask_rows = masks.result() if masks is not None else None
        for req, e in self.grammars.take_faults():  # a mask fill that raised
            fail_request(req, "filling its grammar mask", e)
        to_sample = [(r, i) for r, i in to_sample if r.finish is None]
        took: list[Req] = self._sample(to_sample, logits, mask_rows) if to_sample else []  # they may draft next
        for req, first in [(r, i) for r, i in to_verify if r.finish is None]:
            before = req.output_len - len(req.draft)
            with isolated(req, "verifying its draft"):
                self.speculation.verify(req, logits[first : first + len(req.draft) + 1], mask_rows, self.eos_ids,
                                 self.context_length)
                # a forced draft planned for the next forward is in output_ids already: not generated yet
                self.tokens_generated += req.output_len - len(req.draft) - before
                self.kv.cache_prefix(req)  # only tokens the model confirmed
                took.append(req)
        self.speculation.plan(took, batch, items, features, self.context_length)
        self._reap()

    def _commit(self, batch: Batch, items: list[WorkItem], logits: torch.Tensor) -> tuple[list, list]:
        """Advance each request past the tokens it fed; returns (request, logits row) of those that sample a
        token now, and of those whose draft the model verifies now (the row before the draft)."""
        to_sample, to_verify, row = [], [], 0
        for (req, n), item in zip(batch, items):
            nrows = len(item.logit_offsets)
            req.cached_len += n
            if req.input_logprob_start() < req.prompt_len:
                with isolated(req, "computing its prompt logprobs"):
                    record_input_logprobs(req, item, logits[row : row + nrows])
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
        return to_sample, to_verify

    def _sample(self, to_sample: list[tuple[Req, int]], logits: torch.Tensor, masks: Masks | None) -> list[Req]:
        """Sample each request's next token; returns the requests that took one."""
        reqs = [req for req, _ in to_sample]
        rows = sample_rows(reqs, self.eos_ids)
        selected = logits[[i for _, i in to_sample]]
        if masks is not None:
            self.grammars.apply(selected, reqs, masks)
        result = sample_isolated(selected, rows, reqs)
        settled = self.grammars.settle(selected, reqs, rows, result.next_ids, masks)
        took = []
        for k, req in enumerate(reqs):
            if req.finish is not None:  # failed while sampling or settling
                continue
            with isolated(req, "taking its sampled token"):
                self._take_token(req, k, result, k in settled)
                took.append(req)
        return took

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

    # ---- emit ---------------------------------------------------------------------------
    def _reap(self) -> None:
        """Emit progress; release finished requests."""
        outs = [token_out(req) for req in self.running if has_news(req)]
        done = [r for r in self.running if r.finish is not None]
        gone = [r for r in self.waiting if r.finish is not None]
        outs += [token_out(req) for req in gone]
        for req in done + gone:
            (self.running if req in done else self.waiting).remove(req)
            self.kv.release(req)
            self.speculation.release(req)
            if req.failed:
                self.num_failed += 1
        if outs:
            self.emit(outs)

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
        self.speculation.copy_kv(src, dst, shift)

    # ---- introspection --------------------------------------------------------------
    def flush_cache(self) -> bool:
        if not (self.idle and self.kv.flush()):
            return False
        self.speculation.flush()
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
            "num_retracted": self.admission.num_retracted,
            "num_failed": self.num_failed,
            "num_kv_joins": self.num_kv_joins,
            # the KV accounting checked end to end, when nothing runs (None while busy)
            "kv_check": (self.kv.check() or "ok") if check and self.idle else None,
            "forward_passes": self.forward_passes,
            "tokens_generated": self.tokens_generated,
            **self.grammars.stats(),
            **self.speculation.stats(),
        }
