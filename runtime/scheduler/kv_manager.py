"""KVManager: request rows, slot allocation and the prefix cache, kept consistent together."""

from __future__ import annotations

import torch

from plait.radix_cache import KVAllocator, NoCache, RadixCache, ReqToTokenPool
from plait.runtime.scheduler.req import Req


class KVManager:
    def __init__(self, allocator: KVAllocator, req_to_token: ReqToTokenPool, use_cache: bool):
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.page_size = allocator.page_size
        self.use_cache = use_cache
        self.cache = RadixCache(allocator, self.page_size) if use_cache else NoCache(allocator, self.page_size)

    @property
    def table(self) -> torch.Tensor:
        return self.req_to_token.table

    def available(self) -> int:
        """Slots obtainable now: free ones plus what eviction can reclaim."""
        return self.allocator.free_slots + self.cache.evictable_size

    def match_len(self, req: Req) -> int:
        """How many tokens admission would take from the cache (for lpm ordering)."""
        return min(len(self.cache.match_prefix(req.fill_ids).indices), req.max_prefix_match())

    def admit(self, req: Req) -> bool:
        """Give the request a row and its cached prefix. False if no row is free."""
        row = self.req_to_token.alloc()
        if row is None:
            return False
        limit = req.max_prefix_match()
        limit -= limit % self.page_size
        match = self.cache.match_prefix(req.fill_ids[:limit], count=True)
        m = len(match.indices)
        self.table[row, :m] = match.indices
        self.cache.lock(match.node)
        req.row, req.last_node = row, match.node
        req.cached_len = req.tree_len = req.alloc_len = m
        if req.cached_tokens < 0:  # first admission: report the prompt's cache hit (not a resume's)
            req.cached_tokens = min(m, req.prompt_len)
        return True

    def reserve(self, req: Req, n: int) -> bool:
        """Ensure slots for the next n tokens (from cached_len); evicts cache if short."""
        need = req.cached_len + n - req.alloc_len
        if need <= 0:
            return True
        shortfall = need + self.page_size - self.allocator.free_slots
        if shortfall > 0:
            self.cache.evict(shortfall)
        last_slot = int(self.table[req.row, req.alloc_len - 1]) if req.alloc_len else -1
        slots = self.allocator.alloc_extend(last_slot, req.alloc_len, need)
        if slots is None:
            return False
        self.table[req.row, req.alloc_len : req.alloc_len + need] = slots
        req.alloc_len += need
        return True

    def cache_prefix(self, req: Req) -> None:
        """Hand the request's computed tokens to the radix tree (shareable from now on)."""
        if not self.use_cache:
            return
        aligned = req.cached_len - req.cached_len % self.page_size
        if aligned <= req.tree_len:
            return
        key = req.fill_ids[:aligned]
        slots = self.table[req.row, :aligned]
        present = self.cache.insert(key, slots)
        if present > req.tree_len:  # another request cached these first: ours are duplicates
            self.allocator.free(slots[req.tree_len : present].clone())
        match = self.cache.match_prefix(key)
        self.table[req.row, :aligned] = match.indices
        self.cache.lock(match.node)
        self.cache.unlock(req.last_node)
        req.last_node, req.tree_len = match.node, aligned

    def release(self, req: Req) -> None:
        """Cache what the request computed, free the rest and its row."""
        if req.row is None:
            return
        self.cache_prefix(req)
        own = self.table[req.row, req.tree_len : req.alloc_len]
        self.allocator.free(own.clone())
        self.cache.unlock(req.last_node)
        self.req_to_token.free(req.row)
        req.row, req.last_node = None, None
        req.cached_len = req.tree_len = req.alloc_len = 0

    def flush(self) -> bool:
        """Drop the whole cache; only allowed when no request holds any of it."""
        if self.cache.protected_size:
            return False
        self.cache.evict(self.cache.evictable_size)
        self.cache.reset()
        return True

    def check(self) -> str | None:
        """With no request holding KV: every slot is free or in the cache, no node is locked, every
        row is free, and the tree's invariants hold. None when consistent, else what is wrong."""
        try:
            self.cache.check()
        except AssertionError as e:
            return f"radix tree: {e}"
        stats = self.cache.stats()
        if stats.protected_tokens:
            return f"{stats.protected_tokens} cached tokens are still locked"
        if self.allocator.free_slots + stats.total_tokens != self.allocator.capacity:
            return (f"leaked KV: {self.allocator.free_slots} free + {stats.total_tokens} cached != "
                    f"{self.allocator.capacity} slots")
        rows = self.req_to_token.table.shape[0]
        if self.req_to_token.available != rows:
            return f"{rows - self.req_to_token.available} request rows are still held"
        return None
