"""The interface of a prefix cache, which the scheduler's KV manager talks to: `RadixCache` (the radix tree over
token ids) implements it, and so does `NoCache` (--disable-radix-cache: it keeps nothing). A node is an opaque
handle: the deepest node of a match, which a request locks to keep its prefix alive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch


class MatchResult(NamedTuple):
    indices: torch.Tensor  # KV slots of the matched prefix
    node: object  # deepest matched node (lock it to keep the prefix alive)


@dataclass(frozen=True)
class CacheStats:
    total_tokens: int
    evictable_tokens: int
    protected_tokens: int
    hit_tokens: int
    query_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@runtime_checkable
class PrefixCache(Protocol):
    page_size: int
    evictable_size: int  # tokens of unlocked nodes (evict frees them)
    protected_size: int  # tokens of locked nodes
    window_evictable: int  # window slots no request's window covers (sliding-window layers)
    supports_joins: bool  # insert_join files join edges (concate_and_append)

    def reset(self) -> None:
        """Forget everything (the slots must have been evicted first)."""

    def match_prefix(self, key: list[int], count: bool = False, joins: tuple[str, ...] = (),
                     window: int = 0, namespace: str = "") -> MatchResult:
        """The longest cached page-aligned prefix of `key`, entering the join edges named in `joins`; with
        `window`, the longest whose last `window` tokens have their window slots; `count`: a hit-rate sample;
        `namespace`: only KV cached in it (a LoRA adapter's; "" the base model's)."""

    def insert(self, key: list[int], value: torch.Tensor, joins: tuple[str, ...] = (), namespace: str = "") -> int:
        """Cache key -> KV slots `value`; returns how many leading tokens were cached already (the caller's
        slots for those stay the caller's to free; the rest now belong to the cache)."""

    def insert_join(self, node: object, join: str, key: list[int], value: torch.Tensor) -> object:
        """File KV continuing `node`'s path, not computed causally over it, under a join edge named `join`."""

    def lock(self, node: object) -> None: ...

    def unlock(self, node: object) -> None: ...

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from least recently used unlocked leaves (or all there are)."""

    def evict_window(self, num_tokens: int) -> int: ...

    def lock_window(self, node: object, window: int) -> int: ...

    def unlock_window(self, node: object, covered: int) -> None: ...

    def window_held(self) -> int: ...

    def stats(self) -> CacheStats: ...

    def check(self) -> None:
        """Assert the cache's invariants (tests, and /server_info's kv_check when idle)."""
