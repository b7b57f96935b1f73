"""Radix cache: unit checks and a Hypothesis state machine against a naive model of the cache."""

import inspect

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from plait.radix_cache import KVAllocator, NoCache, PrefixCache, RadixCache


def _alloc(allocator: KVAllocator, n: int) -> torch.Tensor:
    pages = allocator.alloc_pages(n // allocator.page_size)
    assert pages is not None
    ps = allocator.page_size
    return (pages[:, None] * ps + torch.arange(ps)).flatten()


def test_match_insert_split_and_evict():
    alloc = KVAllocator(64)
    cache = RadixCache(alloc)
    a = [1, 2, 3, 4, 5]
    sa = _alloc(alloc, 5)
    assert cache.insert(a, sa) == 0
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.indices.tolist() == sa[:3].tolist()  # split at the divergence
    cache.check()
    b = [1, 2, 3, 7, 8]
    sb = _alloc(alloc, 5)
    assert cache.insert(b, sb) == 3  # the first three were cached: sb[:3] stay the caller's
    alloc.free(sb[:3])
    cache.lock(cache.match_prefix(b).node)
    assert cache.stats().protected_tokens == 5 and cache.stats().evictable_tokens == 2
    freed = cache.evict(100)
    assert freed == 2  # only the unlocked leaf [4, 5]
    assert cache.match_prefix(a).indices.numel() == 3
    cache.check()


def test_join_edges_are_seen_only_by_requests_naming_the_join():
    alloc = KVAllocator(64)
    cache = RadixCache(alloc)
    fork = [1, 2, 3]
    cache.insert(fork + [4, 5], _alloc(alloc, 5))  # branch 0, computed causally
    node = cache.match_prefix(fork + [4, 5]).node
    joined_tail = _alloc(alloc, 2)
    cache.insert_join(node, "j1", [6, 7], joined_tail)  # branch 1's tokens after branch 0
    cache.check()
    seq = fork + [4, 5, 6, 7, 8]
    assert cache.match_prefix(seq).indices.numel() == 5  # causal only: the join edge is invisible
    m = cache.match_prefix(seq, joins=("j1",))
    assert m.indices.numel() == 7 and m.indices[5:].tolist() == joined_tail.tolist()
    # KV computed after the joined tokens hangs below the join edge, so it is joined KV too
    after = _alloc(alloc, 8)
    assert cache.insert(seq, after, joins=("j1",)) == 7
    assert cache.match_prefix(seq, joins=("j1",)).indices.numel() == 8
    assert cache.match_prefix(seq).indices.numel() == 5
    # the same tokens computed causally get their own path beside the join edge
    causal = _alloc(alloc, 8)
    assert cache.insert(seq, causal) == 5
    assert cache.match_prefix(seq).indices[5:].tolist() == causal[5:].tolist()
    assert cache.match_prefix(seq, joins=("j1",)).indices[5:7].tolist() == joined_tail.tolist()
    # a split inside the join edge keeps the edge on top; eviction takes leaves of both paths
    assert cache.match_prefix(fork + [4, 5, 6], joins=("j1",)).indices.numel() == 6
    cache.check()
    assert cache.evict(100) == 3 + 2 + 1 + 1 + 1 + 3  # [1..3], [4,5], joined [6], [7], [8], causal [6..8]
    assert cache.stats().total_tokens == 0
    cache.check()


def test_namespaces_share_prefixes_within_and_never_across():
    """A LoRA adapter's KV (its namespace) is matched by its own requests only; base requests never see it."""
    alloc = KVAllocator(64)
    cache = RadixCache(alloc)
    key = [1, 2, 3, 4, 5, 6]
    in_a = _alloc(alloc, 6)
    assert cache.insert(key, in_a, namespace="lora0") == 0
    assert cache.match_prefix(key).indices.numel() == 0  # the base sees nothing
    assert cache.match_prefix(key, namespace="lora1").indices.numel() == 0  # nor does another adapter
    assert cache.match_prefix([1, 2, 3, 9], namespace="lora0").indices.tolist() == in_a[:3].tolist()  # a split
    base = _alloc(alloc, 6)
    assert cache.insert(key, base) == 0  # the same tokens under the base weights: a path of their own
    assert cache.match_prefix(key).indices.tolist() == base.tolist()
    assert cache.match_prefix(key, namespace="lora0").indices.tolist() == in_a.tolist()
    more = _alloc(alloc, 8)
    assert cache.insert(key + [7, 8], more, namespace="lora0") == 6  # extends within the namespace
    alloc.free(more[:6])
    cache.check()
    assert cache.evict(100) == 6 + 2 + 6
    cache.check()


def test_no_cache_keeps_nothing():
    alloc = KVAllocator(16)
    cache = NoCache(alloc)
    assert cache.insert([1, 2, 3], torch.tensor([1, 2, 3])) == 3  # all slots stay the caller's
    match = cache.match_prefix([1, 2, 3])
    assert match.indices.numel() == 0
    with pytest.raises(ValueError, match="radix cache"):
        cache.insert_join(match.node, "j", [4], torch.tensor([4]))


@pytest.mark.parametrize("cls", [RadixCache, NoCache])
def test_both_caches_implement_the_prefix_cache_interface(cls):
    cache = cls(KVAllocator(16))
    assert isinstance(cache, PrefixCache)
    for name, member in vars(PrefixCache).items():
        if callable(member) and not name.startswith("_"):
            assert inspect.signature(getattr(cls, name)).parameters.keys() == \
                inspect.signature(member).parameters.keys(), name


def test_paged_allocator_extends_within_a_page():
    alloc = KVAllocator(64, page_size=4)
    first = alloc.alloc_extend(-1, 0, 6)
    assert first.tolist()[:4] == list(range(first[0], first[0] + 4)) and len(first) == 6
    more = alloc.alloc_extend(int(first[-1]), 6, 3)
    assert more.tolist()[:2] == [int(first[-1]) + 1, int(first[-1]) + 2]  # fills the open page first
    before = alloc.free_slots
    alloc.free(torch.cat([first, more]))
    assert alloc.free_slots == before + 12


class CacheMachine(RuleBasedStateMachine):
    page_size = 1

    @initialize()
    def setup(self):
        self.alloc = KVAllocator(4096, self.page_size)
        self.cache = RadixCache(self.alloc, self.page_size)
        self.present: dict[tuple, list[int]] = {}  # cached page-aligned prefix -> slots of its last page
        self.keys: list[list[int]] = []
        self.locks: list[tuple] = []  # (node, prefix)

    def _aligned(self, key):
        return key[: len(key) // self.page_size * self.page_size]

    def _naive_match(self, key):
        key = self._aligned(key)
        slots = []
        for i in range(self.page_size, len(key) + 1, self.page_size):
            p = tuple(key[:i])
            if p not in self.present:
                break
            slots.extend(self.present[p])
        return slots

    @rule(key=st.lists(st.integers(0, 3), min_size=1, max_size=16))
    def insert(self, key):
        key = self._aligned(key)
        if not key:
            return
        slots = _alloc(self.alloc, len(key))
        expected_present = len(self._naive_match(key))
        present = self.cache.insert(key, slots)
        assert present == expected_present
        self.alloc.free(slots[:present])  # duplicates stay ours
        ps = self.page_size
        for i in range(present, len(key), ps):
            self.present[tuple(key[: i + ps])] = slots[i : i + ps].tolist()
        self.keys.append(key)

    @rule(key=st.lists(st.integers(0, 3), min_size=1, max_size=16))
    def lock(self, key):
        m = self.cache.match_prefix(key)
        self.cache.lock(m.node)
        self.locks.append((m.node, tuple(self._aligned(key)[: len(m.indices)])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _ = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(1, 40))
    def evict(self, n):
        evictable = self.cache.evictable_size
        free_before = self.alloc.free_slots
        freed = self.cache.evict(n)
        assert freed >= min(n, evictable)
        assert self.alloc.free_slots == free_before + freed
        for _, prefix in self.locks:  # locked prefixes survive eviction
            assert len(self.cache.match_prefix(list(prefix)).indices) == len(prefix)
        # forget what the tree dropped
        for key in self.keys:
            kept = len(self.cache.match_prefix(key).indices)
            for i in range(kept, len(key), self.page_size):
                self.present.pop(tuple(key[: i + self.page_size]), None)

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check()
        stats = self.cache.stats()
        assert stats.total_tokens == len(self.present) * self.page_size
        assert self.alloc.free_slots + stats.total_tokens == self.alloc.capacity
        for key in self.keys[-8:]:
            assert self.cache.match_prefix(key).indices.tolist() == self._naive_match(key)


class PagedCacheMachine(CacheMachine):
    page_size = 2


TestCache = CacheMachine.TestCase
TestCache.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPagedCache = PagedCacheMachine.TestCase
TestPagedCache.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
