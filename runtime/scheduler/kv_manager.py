"""KVManager: request rows, slot allocation and the prefix cache, kept consistent together.

With sliding-window layers kept to their window (`window` > 0, a WindowedKVAllocator): a request holds window slots
for its last `window` tokens only. Those of its own tokens that fall behind are released as it runs; those of its
cached prefix are locked in the tree for as long as it holds that prefix (lock_window), and a prefix is taken from
the cache only as far as its window is intact.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from plait.radix_cache import KVAllocator, NoCache, PrefixCache, RadixCache, ReqToTokenPool
from plait.radix_cache.memory_pool import WindowedKVAllocator
from plait.runtime.scheduler.req import KVState, Req


class JoinResult(NamedTuple):
    ok: bool
    reason: str = ""  # why not, when not ok
    input_ids: list[int] = []  # the joined sequence
    reused: int = 0  # its tokens whose KV came from the cache (all of them when ok)


# window slots behind a request's window are released in runs of at least this many (not one call per token)
_RELEASE_RUN = 16


class KVManager:
    def __init__(self, allocator: KVAllocator, req_to_token: ReqToTokenPool, use_cache: bool, window: int = 0):
        self.allocator = allocator
        # the sliding window whose slots are released behind it; 0 when sliding layers keep every token
        self.window = window if isinstance(allocator, WindowedKVAllocator) else 0
        self.req_to_token = req_to_token
        self.page_size = allocator.page_size
        self.use_cache = use_cache
        self.cache: PrefixCache = RadixCache(allocator, self.page_size) if use_cache else NoCache(allocator, self.page_size)

    @property
    def table(self) -> torch.Tensor:
        return self.req_to_token.table

    def available(self) -> int:
        """Slots obtainable now: free ones plus what eviction can reclaim."""
        return self.allocator.free_slots + self.cache.evictable_size

    def window_room(self) -> int:
        """Window slots obtainable now (free, or held by the cache outside every request's window)."""
        if not self.window:
            return 1 << 62
        return self.allocator.window.free_slots + self.cache.window_evictable

    def match_len(self, req: Req) -> int:
        """How many tokens admission would take from the cache (for lpm ordering)."""
        match = self.cache.match_prefix(req.fill_ids, joins=req.kv_joins, window=self.window,
                                        namespace=req.cache_namespace)
        return min(len(match.indices), req.max_prefix_match())

    def admit(self, req: Req) -> bool:
        """Give the request a row and its cached prefix. False if no row is free."""
        row = self.req_to_token.alloc()
        if row is None:
            return False
        limit = req.max_prefix_match()
        limit -= limit % self.page_size
        match = self.cache.match_prefix(req.fill_ids[:limit], count=True, joins=req.kv_joins, window=self.window,
                                        namespace=req.cache_namespace)
        m = len(match.indices)
        self.table[row, :m] = match.indices
        self.cache.lock(match.node)
        req.kv = KVState(row, match.node, m, m, m, window_released=m,
                         window_covered=self.cache.lock_window(match.node, self.window))
        if req.cached_tokens < 0:  # first admission: report the prompt's cache hit (not a resume's)
            req.cached_tokens = min(m, req.prompt_len)
        return True

    def reserve(self, req: Req, n: int) -> bool:
        """Ensure slots for the next n tokens (from cached_len); evicts cache if short."""
        need = req.kv.cached_len + n - req.kv.alloc_len
        if self.window:
            self._release_behind_window(req, eager=need > self.allocator.window.free_slots)
        if need <= 0:
            return True
        shortfall = need + self.page_size - self.allocator.free_slots
        if shortfall > 0:
            self.cache.evict(shortfall)
        if self.window and need > self.allocator.window.free_slots:
            # a run at a time: each call walks the whole tree
            self.cache.evict_window(max(need - self.allocator.window.free_slots, _RELEASE_RUN))
        last_slot = int(self.table[req.kv.row, req.kv.alloc_len - 1]) if req.kv.alloc_len else -1
        slots = self.allocator.alloc_extend(last_slot, req.kv.alloc_len, need)
        if slots is None:
            return False
        self.table[req.kv.row, req.kv.alloc_len : req.kv.alloc_len + need] = slots
        req.kv.alloc_len += need
        return True

    def computed(self, req: Req, n: int) -> None:
        """A forward computed the request's next `n` tokens."""
        req.kv.cached_len += n

    def keep_verified(self, req: Req, computed: int) -> None:
        """A draft was verified: of the `computed` leading tokens, those the output kept count as cached; the
        rejected ones' slots stay in the row, past the sequence's end, for the next tokens to overwrite."""
        req.kv.cached_len = min(computed, req.seq_len)

    def move_draft_slots(self, req: Req, order: list[int]) -> None:
        """Reorder the KV slots of the request's draft (a tree's kept path first), in step with its tokens."""
        first = req.seq_len
        slots = self.table[req.kv.row, first : first + len(order)]
        slots.copy_(slots[order].clone())

    def cache_prefix(self, req: Req) -> None:
        """Hand the request's computed committed tokens to the radix tree (shareable from now on); a draft's
        are not the sequence's until verified."""
        if not self.use_cache:
            return
        done = min(req.kv.cached_len, req.seq_len)
        aligned = done - done % self.page_size
        if aligned <= req.kv.tree_len:
            return
        key = req.fill_ids[:aligned]
        slots = self.table[req.kv.row, :aligned]
        present = self.cache.insert(key, slots, joins=req.kv_joins, namespace=req.cache_namespace)
        if present > req.kv.tree_len:  # another request cached these first: ours are duplicates
            self.allocator.free(slots[req.kv.tree_len : present].clone())
        match = self.cache.match_prefix(key, joins=req.kv_joins, namespace=req.cache_namespace)
        self.table[req.kv.row, :aligned] = match.indices
        self.cache.lock(match.node)
        covered = self.cache.lock_window(match.node, self.window)
        self.cache.unlock_window(req.kv.last_node, req.kv.window_covered)
        self.cache.unlock(req.kv.last_node)
        req.kv.last_node, req.kv.tree_len, req.kv.window_covered = match.node, aligned, covered

    def release(self, req: Req) -> None:
        """Cache what the request computed, free the rest and its row."""
        if req.kv.row is None:
            return
        self.cache_prefix(req)
        own = self.table[req.kv.row, req.kv.tree_len : req.kv.alloc_len]
        self.allocator.free(own.clone())
        self.cache.unlock_window(req.kv.last_node, req.kv.window_covered)
        self.cache.unlock(req.kv.last_node)
        self.req_to_token.free(req.kv.row)
        req.kv = KVState()

    def _release_behind_window(self, req: Req, eager: bool) -> None:
        """Release the window slots of the request's own tokens (not the tree's) that no later token sees: in runs,
        or all of them at once when window slots are short."""
        start = max(req.kv.window_released, req.kv.tree_len)
        end = req.kv.cached_len - self.window
        if end - start >= (1 if eager else _RELEASE_RUN):
            self.allocator.release_window(self.table[req.kv.row, start:end])
            req.kv.window_released = end

    def join(self, parts: list[list[int]], fork_len: int, joins: tuple[str, ...], join_id: str,
             copy_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]) -> JoinResult:
        """concate_and_append: the KV of parts[0] + parts[1][fork_len:] + parts[2][fork_len:] + ...
        from each part's cached KV, without a forward. Every part starts with the same fork_len
        tokens and must be cached whole (the client prefilled them). parts[0] is reused in place;
        the later parts' KV is copied to new slots by `copy_kv(src, dst, shift)` (keys re-rotated
        by `shift` positions) and filed under a join edge, so only requests naming `join_id` use it."""
        if not self.cache.supports_joins or self.page_size != 1:
            return JoinResult(False, "needs the radix cache with page size 1")
        if self.window:
            return JoinResult(False, "not for a model whose sliding-window layers keep only their window")
        if not parts or any(p[:fork_len] != parts[0][:fork_len] for p in parts) or fork_len < 1:
            return JoinResult(False, "the parts do not share the fork prefix")
        matches = [self.cache.match_prefix(p, joins=joins) for p in parts]
        if any(len(m.indices) < len(p) for m, p in zip(matches, parts)):
            return JoinResult(False, "a branch's KV is no longer cached")
        for m in matches:  # keep them while slots are found (eviction may run)
            self.cache.lock(m.node)
        try:
            tails = [p[fork_len:] for p in parts[1:]]
            n = sum(len(t) for t in tails)
            joined = parts[0] + [t for tail in tails for t in tail]
            if n == 0:
                return JoinResult(True, "", joined, len(parts[0]))
            if self.allocator.free_slots < n:
                self.cache.evict(n - self.allocator.free_slots)
            dst = self.allocator.alloc_pages(n)
            if dst is None:
                return JoinResult(False, "the KV pool is full")
            src = torch.cat([m.indices[fork_len:] for m in matches[1:]])
            shift, offset = [], len(parts[0])
            for tail in tails:  # a tail moves from fork_len onward to after what precedes it
                shift += [offset - fork_len] * len(tail)
                offset += len(tail)
            copy_kv(src, dst, torch.tensor(shift, dtype=torch.int64))
            # match_prefix ends on a node, so parts[0]'s path ends exactly at its node
            self.cache.insert_join(matches[0].node, join_id, joined[len(parts[0]):], dst)
            return JoinResult(True, "", joined, len(joined))
        finally:
            for m in matches:
                self.cache.unlock(m.node)

    def flush(self) -> bool:
        """Drop the whole cache; only allowed when no request holds any of it."""
        if self.cache.protected_size:
            return False
        self.cache.evict(self.cache.evictable_size)
        self.cache.reset()
        return True

    def stats(self) -> dict:
        cache = self.cache.stats()
        window = self.allocator.window if self.window else None
        return {
            "kv_capacity": self.allocator.capacity,
            "kv_free": self.allocator.free_slots,
            # the sliding-window layers' slots (0 when they keep every token's KV)
            "kv_window_capacity": window.capacity if window else 0,
            "kv_window_free": window.free_slots if window else 0,
            "cache_tokens": cache.total_tokens,
            "cache_evictable": cache.evictable_tokens,
            "cache_protected": cache.protected_tokens,
            "cache_hit_rate": cache.hit_rate,
        }

    def check(self, holding: list[Req] = ()) -> str | None:
        """Every slot is free, in the cache, or owned by exactly one of the requests `holding` KV (the admitted
        ones: none when idle); no node is locked and no row held but theirs; the tree's invariants hold (the window
        slots are counted when idle only). None when consistent, else what is wrong."""
        try:
            self.cache.check()
        except AssertionError as e:
            return f"radix tree: {e}"
        stats = self.cache.stats()
        held = [r for r in holding if r.kv.row is not None]
        if stats.protected_tokens and not held:
            return f"{stats.protected_tokens} cached tokens are still locked"
        own = [self.table[r.kv.row, r.kv.tree_len : r.kv.alloc_len] for r in held]
        if own and torch.cat(own).unique().numel() != sum(len(o) for o in own):
            return "two requests own the same KV slot"
        page = self.page_size  # a request holds the whole page its last token is on
        owned = sum(-(-r.kv.alloc_len // page) * page - r.kv.tree_len for r in held)
        if self.allocator.free_slots + stats.total_tokens + owned != self.allocator.capacity:
            return (f"leaked KV: {self.allocator.free_slots} free + {stats.total_tokens} cached + {owned} owned != "
                    f"{self.allocator.capacity} slots")
        if self.window:
            window, cached = self.allocator.window, self.cache.window_held()
            if not held and window.free_slots + cached != window.capacity:
                return f"leaked window KV: {window.free_slots} free + {cached} cached != {window.capacity} slots"
        rows = self.req_to_token.table.shape[0]
        if self.req_to_token.available != rows - len(held):
            return f"{rows - self.req_to_token.available} request rows are held, by {len(held)} requests"
        return None
