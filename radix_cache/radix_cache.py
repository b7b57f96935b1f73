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
- a *namespace* keeps KV computed under different weights apart (a LoRA adapter's): the root's children of a
  namespace are filed under `(namespace, first page)` and only a walk in that namespace enters them (and only
  them), so prefixes are shared within a namespace and never across.

With a `WindowedKVAllocator` (a model with sliding-window layers) a node's tokens may have lost their window slots
(released behind a request's window, or by `evict_window`). Then also:
- `window_live` is the number of the node's tokens that still have one; `window_lock` counts the requests whose
  window covers the node (lock_window), so window_lock <= lock_ref;
- `window_evictable` is the window_live total of nodes with window_lock == 0;
- a match taken with `window` ends where the `window` tokens before its end all have their window slots.
"""

from __future__ import annotations

import heapq
import torch

from plait.radix_cache.memory_pool import KVAllocator, WindowedKVAllocator
from plait.radix_cache.prefix_cache import CacheStats, MatchResult

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "join", "window_live",
                 "window_lock")

    def __init__(self, parent: "TreeNode | None", key: list[int], value: torch.Tensor, tick: int, join: str = ""):
        self.children: dict = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = tick
        self.join = join  # "" for causal KV; a join id for a join edge
        self.window_live = 0
        self.window_lock = 0

    def __lt__(self, other: "TreeNode") -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


def intact_prefix(live: torch.Tensor, window: int, page_size: int) -> int:
    """The longest page-aligned length m <= len(live) whose last `window` tokens are all live (0 if none)."""
    n = live.numel()
    if bool(live[max(0, n - window) :].all()):
        return n
    pos = torch.arange(n)
    last_dead = torch.cummax(torch.where(live, -1, pos), 0).values  # the last dead token at or before each one
    ends = pos + 1
    ok = (last_dead < (ends - window).clamp(min=0)) & (ends % page_size == 0)
    good = torch.nonzero(ok)
    return int(good[-1]) + 1 if good.numel() else 0


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
    """A PrefixCache (prefix_cache.py) over a radix tree of token ids; its invariants are in the module docstring."""

    supports_joins = True

    def __init__(self, allocator: KVAllocator, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size
        self.windowed = isinstance(allocator, WindowedKVAllocator)
        self.reset()

    # ---- public interface -------------------------------------------------------------
    def reset(self) -> None:
        self._tick = 0
        self.root = TreeNode(None, [], _EMPTY, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self.window_evictable = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    def match_prefix(self, key: list[int], count: bool = False, joins: tuple[str, ...] = (),
                     window: int = 0, namespace: str = "") -> MatchResult:
        """Longest cached page-aligned prefix of `key`, entering the join edges named in `joins`; with `window`,
        the longest whose last `window` tokens have their window slots. Splits a node so the match ends on a node."""
        key = self._aligned(key)
        node, path = self._walk(key, split=True, joins=joins, namespace=namespace)
        indices = torch.cat([n.value for n in path]) if path else _EMPTY
        if window and self.windowed and len(indices):
            usable = intact_prefix(self.allocator.window_live(indices), window, self.page_size)
            if usable < len(indices):
                node, _ = self._walk(key[:usable], split=True, joins=joins, namespace=namespace)
                indices = indices[:usable]
        if count:
            self.hit_tokens += len(indices)
            self.query_tokens += len(key)
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor, joins: tuple[str, ...] = (), namespace: str = "") -> int:
        """Insert key -> slots along the path match_prefix(key, joins=joins) walks. Returns how many
        leading tokens were already cached: the caller's slots for those are duplicates and stay the
        caller's to free. The rest now belong to the tree."""
        key = self._aligned(key)
        value = value[: len(key)]
        node, path = self._walk(key, split=True, joins=joins, namespace=namespace)
        matched = sum(len(n.key) for n in path)
        if self.windowed and matched:
            self._take_windows(path, value[:matched])
        if matched < len(key):
            self._add_child(node, key[matched:], value[matched:].clone(), namespace if node is self.root else "")
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
            self.window_evictable -= leaf.window_live
            parent = leaf.parent
            del parent.children[self._filed_key(leaf)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def evict_window(self, num_tokens: int) -> int:
        """Free at least num_tokens window slots (or all there are) from the least recently used nodes no request's
        window covers; their full KV stays (a longer prefix that still has its window can use it)."""
        if not self.windowed:
            return 0
        nodes = sorted(n for n in self._nodes() if n.window_live and not n.window_lock and n is not self.root)
        freed = 0
        for node in nodes:
            if freed >= num_tokens:
                break
            self.allocator.release_window(node.value)
            freed += node.window_live
            self.window_evictable -= node.window_live
            node.window_live = 0
        return freed

    def lock_window(self, node: TreeNode, window: int) -> int:
        """Keep the window slots of the last `window` tokens up to `node` (a request's window over its cached
        prefix); a node is cut so the lock covers no more than that, rounded up to a page. Returns the tokens
        covered, for unlock_window: splits add node boundaries and never remove one, so the same count finds
        the same nodes later."""
        if not self.windowed:
            return 0
        covered = 0
        while node is not self.root and covered < window:
            over = covered + len(node.key) - window
            over -= over % self.page_size
            if over > 0:  # only the node's last tokens are in the window: cut them off
                self._split(node, over)
            if node.window_lock == 0:
                self.window_evictable -= node.window_live
            node.window_lock += 1
            covered += len(node.key)
            node = node.parent
        return covered

    def unlock_window(self, node: TreeNode, covered: int) -> None:
        done = 0
        while done < covered:
            node.window_lock -= 1
            if node.window_lock < 0:
                raise RuntimeError("radix cache: unlock_window without matching lock_window")
            if node.window_lock == 0:
                self.window_evictable += node.window_live
            done += len(node.key)
            node = node.parent

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
        evictable = protected = window_evictable = 0
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
            if self.windowed:
                assert node.window_live == self.allocator.window_count(node.value), "window_live count"
                assert 0 <= node.window_lock <= node.lock_ref, "window lock outside the request's lock"
                window_evictable += 0 if node.window_lock else node.window_live
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self.evictable_size, f"evictable {evictable} != {self.evictable_size}"
        assert protected == self.protected_size, f"protected {protected} != {self.protected_size}"
        assert window_evictable == self.window_evictable, f"window {window_evictable} != {self.window_evictable}"

    def window_held(self) -> int:
        """Window slots the tree holds."""
        return sum(n.window_live for n in self._nodes())

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
        if self.windowed:
            child.window_live = self.allocator.window_count(value)
            self.window_evictable += child.window_live
        return child

    def _take_windows(self, path: list[TreeNode], value: torch.Tensor) -> None:
        """Where a cached token lost its window slot and the caller's copy of it (being inserted, a duplicate)
        still has one, the tree takes the caller's: a prefix whose window was released is whole again."""
        window_of = self.allocator.window_of
        pos = 0
        for node in path:
            mine = value[pos : pos + len(node.key)]
            pos += len(node.key)
            take = (window_of[node.value] == 0) & (window_of[mine] != 0) & (mine != node.value)
            n = int(take.sum())
            if n:
                window_of[node.value[take]] = window_of[mine[take]]
                window_of[mine[take]] = 0
                node.window_live += n
                if not node.window_lock:
                    self.window_evictable += n

    def _walk(self, key: list[int], split: bool, joins: tuple[str, ...] = (), namespace: str = ""
              ) -> tuple[TreeNode, list[TreeNode]]:
        """The deepest node matching `key` and the nodes on the way to it (root excluded); from the root, only
        the children of `namespace` when one is given."""
        node, path, pos = self.root, [], 0
        tick = self._next_tick()
        node.last_access = tick
        while pos < len(key):
            first = self._child_key(key[pos:])
            child = None
            if namespace and node is self.root:
                child = node.children.get((namespace, first))
            else:
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
            path.append(child)
            pos += n
            node = child
        return node, path

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n tokens; returns the new upper node."""
        # the upper part takes the child's place (and its join edge); the lower part hangs below it
        upper = TreeNode(child.parent, child.key[:n], child.value[:n].clone(), child.last_access, child.join)
        upper.lock_ref = child.lock_ref
        upper.window_lock = child.window_lock  # a window lock covers whole nodes: both parts
        if self.windowed:
            upper.window_live = self.allocator.window_count(upper.value)
            child.window_live -= upper.window_live
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
