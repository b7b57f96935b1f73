"""Admission and retraction: which requests run in the next forward, and which give their KV back.

Every running request that decodes gets one slot; waiting requests are admitted as prefill chunks under
a token budget (`max_prefill_tokens`, `chunked_prefill_size`) while the KV left covers a share of what
the running ones will still generate. When KV runs out, the cache is evicted first (KVManager), then the
newest running requests are retracted to the front of the queue: their computed tokens stay cached, so
resuming is cheap.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from plait.radix_cache.radix_cache import common_prefix_len
from plait.runtime.forward.batch import ForwardMode
from plait.runtime.ipc.messages import FinishReason
from plait.runtime.narrow_config import NarrowConfig
from plait.runtime.scheduler.kv_manager import KVManager
from plait.runtime.scheduler.policy import fair_order, order_waiting
from plait.runtime.scheduler.req import Req
from plait.runtime.scheduler.step import Work

logger = logging.getLogger(__name__)

# admission reserves this share of each request's remaining decode budget; it decays while
# nothing is retracted and jumps back up after a retraction (SGLang's new_token_ratio)
_RATIO_INIT, _RATIO_MIN, _RATIO_DECAY = 0.7, 0.1, 0.002
# a waiting request sharing at least this many more tokens with one admitted in the same step
# than with the cache waits one step, so it reuses that one's prefix instead of recomputing it
_IN_BATCH_SHARE = 32
# the most of a request's remaining decode budget that admission reserves room for
_RESERVE_CAP = 4096


@dataclass(frozen=True)
class AdmissionConfig(NarrowConfig):
    max_prefill_tokens: int
    chunked_prefill_size: int  # <= 0: no chunking
    max_running_requests: int
    schedule_policy: str


class Admission:
    """Owns the queues: `waiting` (not holding KV) and `running` (admitted, prefilling or decoding).
    `on_retract(req)` drops what a retracted request had planned beyond its KV (its draft)."""

    def __init__(self, config: AdmissionConfig, kv: KVManager, on_retract: Callable[[Req], None]):
        self.config = config
        self.kv = kv
        self.on_retract = on_retract
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = _RATIO_INIT
        self.num_retracted = 0

    def stuck(self) -> None:
        """No batch could be formed: free memory by retracting, or fail what can never run (reap it)."""
        if len(self.running) > 1:
            self.retract(self.running[-1])
            return
        req = self.running[0] if self.running else self.waiting[0]
        req.end(FinishReason("abort", message="request does not fit the KV cache"))

    def stepped(self) -> None:
        """A forward ran: reserve a little less for running requests next time (a retraction resets it)."""
        self.new_token_ratio = max(_RATIO_MIN, self.new_token_ratio - _RATIO_DECAY)

    def retract(self, req: Req) -> None:
        self.on_retract(req)
        self.kv.release(req)  # its computed tokens stay in the cache: resuming is cheap
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.num_retracted += 1
        req.num_retractions += 1
        self.new_token_ratio = _RATIO_INIT
        logger.debug("retracted %s at %d tokens", req.rid, req.seq_len)

    def reserve_decode(self) -> list[Work]:
        """One slot for every decoding request, retracting the newest ones while short (a request that cannot
        grow at all finishes: reap it before `admit`)."""
        decoding = [r for r in self.running if r.pending_len == 1]
        out: list[Work] = []
        while decoding:
            req = decoding.pop(0)
            while not self.kv.reserve(req, 1):
                victim = self._pick_victim(exclude=req)
                if victim is None:  # nothing left to retract: this request cannot grow
                    req.end(FinishReason("length", message="KV cache is full"))
                    break
                if victim in decoding:
                    decoding.remove(victim)
                out = [w for w in out if w.req is not victim]
                self.retract(victim)
            if req.finish is None:
                out.append(Work(req, 1, ForwardMode.DECODE))
        return out

    def _pick_victim(self, exclude: Req) -> Req | None:
        candidates = [r for r in self.running if r is not exclude and r.finish is None]
        return candidates[-1] if candidates else None

    def _continue_prefills(self, budget: int, chunk_cap: int) -> list[Work]:
        """The next chunks of admitted requests still prefilling, and the drafts to verify (each whole)."""
        out: list[Work] = []
        for req in self.running:
            if req.pending_len > 1 and budget > 0:
                n = min(req.pending_len, chunk_cap, budget)
                verify = bool(req.draft.tokens)
                if verify and n < req.pending_len:
                    continue  # a draft is verified in one forward
                if not self.kv.reserve(req, n):
                    break
                out.append(Work(req, n, ForwardMode.TARGET_VERIFY if verify else ForwardMode.EXTEND))
                budget -= n
        return out

    def admit(self, budget: int) -> list[Work]:
        """Prefill chunks (and drafts) for requests already admitted, then chunks of newly admitted ones."""
        cfg = self.config
        chunk_cap = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else 1 << 30
        out = self._continue_prefills(budget, chunk_cap)
        budget -= sum(w.n for w in out)
        if budget <= 0 or not self.waiting:
            return out
        ordered = fair_order(order_waiting(self.waiting, cfg.schedule_policy, self.kv), self.running)
        reserved = sum(min(r.remaining_tokens(), _RESERVE_CAP) for r in self.running) * self.new_token_ratio
        admitted: list[Req] = []
        prefilling = [r for r in self.running if r.pending_len > 1]  # their prefixes reach the cache soon
        for req in ordered:
            if budget <= 0 or len(self.running) >= cfg.max_running_requests:
                break
            cached = self.kv.match_len(req)
            if (admitted or prefilling) and self._should_wait_for_sibling(req, cached, admitted + prefilling):
                continue
            n = min(req.seq_len - cached, chunk_cap, budget)
            if req.whole and n < req.seq_len:  # an encoder's prompt runs in one forward, or waits for one
                n = req.seq_len
                if n > budget:
                    continue
            future = min(req.remaining_tokens(), _RESERVE_CAP) * self.new_token_ratio
            if self.running and (self.kv.available() - reserved < n + future  # room for what running ones will generate
                                 or self.kv.window_room() < n + self.kv.window):
                break
            if not self.kv.admit(req):
                break
            n = req.pending_len if req.whole else min(req.pending_len, chunk_cap, budget)
            if not self.kv.reserve(req, n):
                self.kv.release(req)
                break
            self._start(req)
            admitted.append(req)
            out.append(Work(req, n, ForwardMode.EXTEND))
            budget -= n
            reserved += future
        return out

    def _start(self, req: Req) -> None:
        self.waiting.remove(req)
        self.running.append(req)
        if req.queue_time is None:  # first admission (a retracted request keeps its first wait)
            req.queue_time = time.perf_counter() - req.arrival

    def _should_wait_for_sibling(self, req: Req, cached: int, siblings: list[Req]) -> bool:
        shared = max(common_prefix_len(req.fill_ids, other.fill_ids) for other in siblings)
        return shared - cached >= _IN_BATCH_SHARE
