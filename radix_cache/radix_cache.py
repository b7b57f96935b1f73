"""Radix tree over token ids whose nodes own KV slots: the cross-request prefix cache.

Invariants (checked by `check()`):
- every non-root node has a non-empty key, `len(key) == len(value)`, and both are multiples
  of `page_size`; a child is filed under the first page of its key;
- a node's `lock_ref` is the number of lock() calls on it or on any node below it
  (so a parent's lock_ref >= each child's), and locked nodes are never evicted;
- `evictable_size` / `protected_size` are the token totals of unlocked / locked nodes;
- no KV slot appears in two nodes;
- a *join edge* (a node with a non-empty `join`) holds KV that was not computed causally over
  its path (concate_and_append: branches encoded side by side, their keys re-rotated to the
  joined positions). It is filed under `(join, first page)`, so only a walk that names the join
  enters it; everything below it is reachable only through it. Requests that name no join never
  see such KV, so the tree stays exact for them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

import torch

from plait.radix_cache.memory_pool import KVAllocator

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "join")

    def __init__(self, parent: "TreeNode | None", key: list[int], value: torch.Tensor, tick: int, join: str = ""):
        self.children: dict = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = tick
        self.join = join  # "" for causal KV; a join id for a join edge

    def __lt__(self, other: "TreeNode") -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


class MatchResult(NamedTuple):
    indices: torch.Tensor  # KV slots of the matched prefix
    node: TreeNode  # deepest matched node (lock it to keep the prefix alive)


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


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    step = 64
    while i + step <= n and a[i : i + step] == b[i : i + step]:  # slice compares run in C
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, allocator: KVAllocator, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size
        self.reset()

    # ---- public interface -------------------------------------------------------------
    def reset(self) -> None:
        self._tick = 0
        self.root = TreeNode(None, [], _EMPTY, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    def match_prefix(self, key: list[int], count: bool = False, joins: tuple[str, ...] = ()) -> MatchResult:
        """Longest cached page-aligned prefix of `key`, entering the join edges named in `joins`.
        Splits a node so the match ends on a node."""
        key = self._aligned(key)
        node, values = self._walk(key, split=True, joins=joins)
        indices = torch.cat(values) if values else _EMPTY
        if count:
            self.hit_tokens += len(indices)
            self.query_tokens += len(key)
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor, joins: tuple[str, ...] = ()) -> int:
        """Insert key -> slots along the path match_prefix(key, joins=joins) walks. Returns how many
        leading tokens were already cached: the caller's slots for those are duplicates and stay the
        caller's to free. The rest now belong to the tree."""
        key = self._aligned(key)
        value = value[: len(key)]
        node, values = self._walk(key, split=True, joins=joins)
        matched = sum(len(v) for v in values)
        if matched < len(key):
            self._add_child(node, key[matched:], value[matched:].clone(), "")
        return matched

    def insert_join(self, node: TreeNode, join: str, key: list[int], value: torch.Tensor) -> TreeNode:
        """File KV that continues `node`'s path but was not computed causally over it under a join
        edge named `join` (see the module docstring). The slots now belong to the tree."""
        if not join or not key or len(key) != len(value) or len(key) % self.page_size:
            raise ValueError("a join edge needs a name and a non-empty, page-aligned key with one slot per token")
        if self._filed_key_of(join, key) in node.children:
            raise ValueError(f"join {join!r} already has an edge here")
        return self._add_child(node, list(key), value.clone(), join)

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            if node.lock_ref < 0:
                raise RuntimeError("radix cache: unlock without matching lock")
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from least-recently-used unlocked leaves (or all there are)."""
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[self._filed_key(leaf)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def stats(self) -> CacheStats:
        return CacheStats(
            total_tokens=self.evictable_size + self.protected_size,
            evictable_tokens=self.evictable_size,
            protected_tokens=self.protected_size,
            hit_tokens=self.hit_tokens,
            query_tokens=self.query_tokens,
        )

    def check(self) -> None:
        """Assert every invariant in the module docstring."""
        seen: set[int] = set()
        evictable = protected = 0
        for node in self._nodes():
            if node is self.root:
                continue
            assert node.key, "empty non-root node"
            assert len(node.key) == len(node.value), "key/value length mismatch"
            assert len(node.key) % self.page_size == 0, "node not page aligned"
            assert node.parent.children.get(self._filed_key(node)) is node, "child filed under wrong key"
            below = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= max((c.lock_ref for c in node.children.values()), default=0), "lock order"
            assert node.lock_ref >= 0 and below >= 0
            slots = node.value.tolist()
            assert not seen.intersection(slots), "slot owned by two nodes"
            seen.update(slots)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self.evictable_size, f"evictable {evictable} != {self.evictable_size}"
        assert protected == self.protected_size, f"protected {protected} != {self.protected_size}"

    # ---- internals --------------------------------------------------------------------
    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _aligned(self, key: list[int]) -> list[int]:
        ps = self.page_size
        return list(key) if ps == 1 else list(key[: len(key) // ps * ps])

    def _child_key(self, key: list[int]):
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _filed_key_of(self, join: str, key: list[int]):
        return (join, self._child_key(key)) if join else self._child_key(key)

    def _filed_key(self, node: TreeNode):
        return self._filed_key_of(node.join, node.key)

    def _add_child(self, node: TreeNode, key: list[int], value: torch.Tensor, join: str) -> TreeNode:
        child = TreeNode(node, key, value, self._next_tick(), join)
        node.children[self._filed_key(child)] = child
        self.evictable_size += len(key)
        return child

    def _walk(self, key: list[int], split: bool, joins: tuple[str, ...] = ()) -> tuple[TreeNode, list[torch.Tensor]]:
        node, values, pos = self.root, [], 0
        tick = self._next_tick()
        node.last_access = tick
        while pos < len(key):
            first = self._child_key(key[pos:])
            child = None
            for join in reversed(joins):  # a join edge wins over the causal path (the newest join first)
                child = node.children.get((join, first))
                if child is not None:
                    break
            if child is None:
                child = node.children.get(first)
            if child is None:
                break
            n = common_prefix_len(child.key, key[pos:])
            n -= n % self.page_size
            if n < len(child.key):
                if n == 0 or not split:
                    break
                child = self._split(child, n)
            child.last_access = tick
            values.append(child.value)
            pos += n
            node = child
        return node, values

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n tokens; returns the new upper node."""
        # the upper part takes the child's place (and its join edge); the lower part hangs below it
        upper = TreeNode(child.parent, child.key[:n], child.value[:n].clone(), child.last_access, child.join)
        upper.lock_ref = child.lock_ref
        upper.parent.children[self._filed_key(upper)] = upper
        child.key = child.key[n:]
        child.value = child.value[n:].clone()
        child.parent = upper
        child.join = ""
        upper.children[self._filed_key(child)] = child
        return upper

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
