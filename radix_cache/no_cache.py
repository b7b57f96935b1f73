"""A prefix cache that caches nothing, with RadixCache's interface (--disable-radix-cache)."""

from __future__ import annotations

import torch

from plait.radix_cache.radix_cache import CacheStats, MatchResult, TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


class NoCache:
    def __init__(self, allocator, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size
        self.root = TreeNode(None, [], _EMPTY, 0)
        self.evictable_size = 0
        self.protected_size = 0
        self.window_evictable = 0

    def reset(self) -> None:
        pass

    def match_prefix(self, key: list[int], count: bool = False, joins: tuple[str, ...] = (),
                     window: int = 0) -> MatchResult:
        return MatchResult(_EMPTY, self.root)

    def insert(self, key: list[int], value: torch.Tensor, joins: tuple[str, ...] = ()) -> int:
        # Takes nothing: reporting the whole key as "already cached" leaves every slot to the caller to free.
        return len(key) // self.page_size * self.page_size

    def lock(self, node: TreeNode) -> None:
        pass

    def unlock(self, node: TreeNode) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evict_window(self, num_tokens: int) -> int:
        return 0

    def lock_window(self, node: TreeNode, window: int) -> int:
        return 0

    def unlock_window(self, node: TreeNode, covered: int) -> None:
        pass

    def window_held(self) -> int:
        return 0

    def stats(self) -> CacheStats:
        return CacheStats(0, 0, 0, 0, 0)

    def check(self) -> None:
        pass
