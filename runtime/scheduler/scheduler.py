"""Scheduler: continuous batching around a short loop of small managers.

    step: admit -> forward -> sample or verify -> commit -> emit

Admission (admission.py) picks the next forward's work (a `Work` each, step.py): one token for every decoding
request, whole drafts to verify, and prefill chunks for waiting ones under a token budget, retracting the newest
requests when KV runs out. KV and the radix cache are KVManager's, grammars GrammarManager's, drafts and their
verification SpecManager's, an embedding request's pooled states pooling.py's; each writes its own part of a
request (req.py). A fault in one request fails it alone (faults.py).

An embedding request is a prompt that generates nothing: its forwards capture the final hidden states, which
it pools, and it ends once its prompt is computed. An encoder model (not causal) serves embeddings only, each
prompt whole in one forward and nothing cached.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from plait.runtime.ipc.limits import RuntimeLimits, validate_request
from plait.runtime.forward.batch import FINAL_HIDDEN
from plait.runtime.ipc.messages import AbortReq, FinishReason, JoinKVReq, TokenizedGenerateReq, TokenOut
from plait.runtime.model_executor.model_runner import ForwardOutput, ModelRunner
from plait.runtime.model_loader.tokenizer import end_ids
from plait.runtime.narrow_config import NarrowConfig
from plait.runtime.sampling.sampler import SampleResult
from plait.runtime.scheduler.admission import Admission, AdmissionConfig
from plait.runtime.scheduler.batch_sampler import sample_isolated, sample_rows
from plait.runtime.scheduler.faults import fail_request, isolated
from plait.runtime.scheduler.grammar_manager import GrammarConfig, GrammarManager, Masks
from plait.runtime.scheduler.kv_manager import KVManager
from plait.runtime.scheduler.pooling import pool_chunk
from plait.runtime.scheduler.req import Req
from plait.runtime.scheduler.req_io import has_news, record_input_logprobs, take_token, token_out
from plait.runtime.scheduler.spec_manager import SpecManager
from plait.runtime.scheduler.step import Step
from plait.runtime.speculative.config import DraftConfig
from plait.runtime.speculative.drafter import build_drafter


@dataclass(frozen=True)
class SchedulerConfig(NarrowConfig):
    max_prefill_tokens: int
    random_seed: int
    disable_radix_cache: bool
    dtype: str


class Scheduler:
    def __init__(self, args, runner: ModelRunner, emit: Callable[[list[TokenOut]], None]):
        """`args`: a ServerArgs; the scheduler keeps its SchedulerConfig and gives each manager its own."""
        self.config = SchedulerConfig.of(args)
        self.runner = runner
        self.emit = emit
        self.tokenizer = runner.tokenizer
        model = runner.config
        self.causal = model.causal
        self.kv = KVManager(runner.allocator, runner.req_to_token, not self.config.disable_radix_cache and self.causal,
                            runner.kv_window)
        # an encoder's prompt runs in one forward: no longer than one forward's budget
        self.context_length = (runner.context_length if self.causal
                               else min(runner.context_length, self.config.max_prefill_tokens))
        self.eos_ids = set(end_ids(runner.config, runner.tokenizer))
        self._seed_counter = self.config.random_seed
        self.num_failed = 0  # requests ended by a fault of their own (status 500, or 400 for a grammar's limit)
        self.num_kv_joins = 0
        self.forward_passes = 0
        self.tokens_generated = 0
        self.grammars = GrammarManager(GrammarConfig.of(args), self.tokenizer, runner.config.vocab_size, sorted(self.eos_ids))
        drafts = DraftConfig.of(args)
        self.speculation = SpecManager(drafts, self.tokenizer, self.grammars, self.kv, build_drafter(drafts, runner))
        self.admission = Admission(AdmissionConfig.of(args), self.kv, self.speculation.drop)
        self.limits = RuntimeLimits(self.context_length, runner.allocator.capacity, model.vocab_size,
                                    runner.weight_bytes, model.hidden_size, self.causal, model.matryoshka)

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
        pooling = (msg.embed.pooling or self.runner.config.pooling) if msg.embed is not None else None
        slot = self._acquire_lora(msg.lora) if msg.lora is not None else -1
        req = Req(msg, self._seed_counter, pooling, whole=not self.causal, lora_slot=slot)
        try:
            if req.params.grammar is None:
                self.waiting.append(req)
            else:  # parked until its grammar compiles
                self.grammars.submit(req, *req.params.grammar)
        except BaseException:
            if msg.lora is not None:
                self.runner.lora.release(msg.lora)
            raise

    def _acquire_lora(self, name: str) -> int:
        if self.runner.lora is None:
            raise ValueError("this model takes no LoRA adapter")
        return self.runner.lora.acquire(name).slot

    def load_lora(self, name: str, path: str) -> dict:
        """Register an adapter: {"adapters"} (every name now served), or {"error"} (nothing changed)."""
        return self._lora_change(lambda lora: lora.register(name, path))

    def unload_lora(self, name: str) -> dict:
        """Unregister an adapter (the requests running with it finish with it): as load_lora."""
        return self._lora_change(lambda lora: lora.unregister(name))

    def _lora_change(self, change: Callable) -> dict:
        if self.runner.lora is None:
            return {"error": "this model takes no LoRA adapter"}
        try:
            change(self.runner.lora)
        except ValueError as e:
            return {"error": str(e)}
        return {"adapters": self.runner.lora.names()}

    def abort(self, msg: AbortReq) -> None:
        for queue in (self.grammars.compiling, self.waiting, self.running):
            for req in queue:
                if req.rid == msg.rid and req.finish is None:
                    req.end(FinishReason("abort", message="aborted"))
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
        """admit -> forward -> sample or verify -> commit -> emit, if there is work. Returns False when idle."""
        if self.idle:
            return False
        if self.grammars.compiling:
            self.waiting.extend(self.grammars.poll())
            self._reap()  # reports the ones whose grammar failed
        decodes = self.admission.reserve_decode()
        self._reap()  # those that could not grow
        works = self.admission.admit(self.config.max_prefill_tokens - len(decodes)) + decodes
        if not works:
            return self._wait()
        step = Step(works)
        masks = self.grammars.start_masks(step.completing())
        self._budget_next_drafts()
        tokens_before, start = self.tokens_generated, time.perf_counter()
        out, hidden = self._forward(step)
        if step.decoding_only:  # what drafts are weighed against
            self.speculation.record_forward(step.tokens(), time.perf_counter() - start)
        self._process(step, out, masks, hidden)
        if step.decoding_only:
            self.speculation.record_step(len(step), step.speculative, self.tokens_generated - tokens_before,
                                         time.perf_counter() - start)
        self.admission.stepped()
        return True

    def _budget_next_drafts(self) -> None:
        """The rows the drafts planned after this step's forward may add to the next one: drafts pay while a
        forward is bandwidth-bound, so they stay within the token budgets beside the running requests."""
        self.speculation.set_budget(len(self.running), len(self.waiting))
        self.grammars.set_budget(len(self.running))

    def _wait(self) -> bool:
        """No forward could be formed: unstick the queues, or wait for a grammar."""
        if self.waiting or self.running:
            self.admission.stuck()
            self._reap()
        elif self.grammars.compiling:  # nothing to run until a grammar is ready
            self.grammars.wait()
        return not self.idle

    def _forward(self, step: Step) -> tuple[ForwardOutput, list[torch.Tensor] | None]:
        """The forward's output, and each item's final hidden states when an embedding request is in the step."""
        self.forward_passes += 1
        # the draft head, if any, reads the target's features at every committed position
        capture = self.speculation.capture
        if not any(r.embedding is not None for r in step.reqs):
            return self.runner.forward(step.items, capture), None
        out = self.runner.forward(step.items, capture + (FINAL_HIDDEN,))
        h = self.runner.config.hidden_size
        features = [f[:, :-h] for f in out.features] if capture else None
        return ForwardOutput(out.logits, features), [f[:, -h:] for f in out.features]

    # ---- commit: what the forward computed ----------------------------------------------
    def _process(self, step: Step, out: ForwardOutput, masks: Future | None,
                 hidden: list[torch.Tensor] | None = None) -> None:
        to_sample, to_verify = self._commit(step, out, hidden)
        mask_rows = masks.result() if masks is not None else None
        for req, e in self.grammars.take_faults():  # a mask fill that raised
            fail_request(req, "filling its grammar mask", e)
        to_sample = [(r, i) for r, i in to_sample if r.finish is None]
        took: list[Req] = self._sample(to_sample, out, mask_rows) if to_sample else []  # they may draft next
        for req, first in [(r, i) for r, i in to_verify if r.finish is None]:
            before = req.output_len
            with isolated(req, "verifying its draft"):
                self.speculation.verify(req, out.logits[first : first + len(req.draft.tokens) + 1], mask_rows,
                                        self.eos_ids, self.context_length)
                self.tokens_generated += req.output_len - before
                self.kv.cache_prefix(req)  # only tokens the model confirmed
                took.append(req)
        self.speculation.plan(took, step, out.features, self.context_length)
        self._reap()

    def _commit(self, step: Step, out: ForwardOutput, hidden: list[torch.Tensor] | None
                ) -> tuple[list[tuple[Req, int]], list[tuple[Req, int]]]:
        """Advance each request past the tokens it fed (an embedding request pools their states); returns
        (request, logits row) of those that sample a token now, and of those whose draft the model verifies now
        (the row before the draft)."""
        to_sample, to_verify = [], []
        for i, p in enumerate(step.planned):
            req = p.req
            if req.embedding is not None:
                with isolated(req, "pooling its embedding"):
                    pool_chunk(req.embedding, p.item.cached_len, hidden[i], req.prompt_len)
            self.kv.computed(req, p.work.n)
            if req.input_logprob_start() < req.prompt_len:
                with isolated(req, "computing its prompt logprobs"):
                    record_input_logprobs(req, p.item, out.logits[p.rows.start : p.rows.stop])
            if p.completes:
                if req.embedding is not None:
                    if req.finish is None:  # not failed while pooling
                        req.end(FinishReason("stop"))
                elif req.params.max_new_tokens == 0:
                    req.end(FinishReason("length"))  # prefill-only: the prompt is now cached
                elif req.draft.tokens:
                    to_verify.append((req, p.next_row))
                else:
                    to_sample.append((req, p.next_row))
            if p.work.n > 1 and not req.draft.tokens:
                self.kv.cache_prefix(req)  # siblings waiting on this prefix can share it now
        return to_sample, to_verify

    def _sample(self, to_sample: list[tuple[Req, int]], out: ForwardOutput, masks: Masks | None) -> list[Req]:
        """Sample each request's next token; returns the requests that took one."""
        reqs = [req for req, _ in to_sample]
        rows = sample_rows(reqs, self.eos_ids)
        selected = out.logits[[i for _, i in to_sample]]
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
        logprob = top = None
        if result.logprobs is not None:
            logprob = (result.logprobs[k], tok)
            if result.top_logprobs is not None:
                top = list(zip(*result.top_logprobs[k]))
        take_token(req, tok, logprob, top)
        self.tokens_generated += 1
        if req.matcher is not None:
            self.speculation.force(req, self.grammars.on_token(req, tok, self.eos_ids, self.context_length,
                                                               accepted=accepted))
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
            if req.lora is not None:
                self.runner.lora.release(req.lora)
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
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            **self.kv.stats(),
            "dtype": self.config.dtype,
            **self.runner.describe(),
            "num_retracted": self.admission.num_retracted,
            "num_failed": self.num_failed,
            "num_kv_joins": self.num_kv_joins,
            # the KV accounting checked end to end, when nothing runs (None while busy)
            "kv_check": (self.kv.check() or "ok") if check and self.idle else None,
            "forward_passes": self.forward_passes,
            "tokens_generated": self.tokens_generated,
            **self.grammars.stats(),
            **self.speculation.stats(),
            **(self.runner.lora.stats() if self.runner.lora is not None else {}),
        }
