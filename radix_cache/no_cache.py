"""A PrefixCache that caches nothing (--disable-radix-cache): every match is empty and every insert leaves the
caller its slots, so each request computes and frees its own KV."""

from __future__ import annotations

import torch

from plait.radix_cache.prefix_cache import CacheStats, MatchResult

_EMPTY = torch.empty(0, dtype=torch.int64)
_ROOT = object()  # the one node: the empty prefix


class NoCache:
    supports_joins = False  # a join edge needs a tree to hang from

    def __init__(self, allocator, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size
        self.evictable_size = 0
        self.protected_size = 0
        self.window_evictable = 0

    def reset(self) -> None:
        pass

    def match_prefix(self, key: list[int], count: bool = False, joins: tuple[str, ...] = (),
                     window: int = 0, namespace: str = "") -> MatchResult:
        return MatchResult(_EMPTY, _ROOT)

    def insert(self, key: list[int], value: torch.Tensor, joins: tuple[str, ...] = (), namespace: str = "") -> int:
        # Takes nothing: reporting the whole key as "already cached" leaves every slot to the caller to free.
        return len(key) // self.page_size * self.page_size

    def insert_join(self, node: object, join: str, key: list[int], value: torch.Tensor) -> object:
        raise ValueError("joins need the radix cache (the server runs with --disable-radix-cache)")

    def lock(self, node: object) -> None:
        pass

    def unlock(self, node: object) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evict_window(self, num_tokens: int) -> int:
        return 0

    def lock_window(self, node: object, window: int) -> int:
        return 0

    def unlock_window(self, node: object, covered: int) -> None:
        pass

    def window_held(self) -> int:
        return 0

    def stats(self) -> CacheStats:
        return CacheStats(0, 0, 0, 0, 0)

    def check(self) -> None:
        pass
