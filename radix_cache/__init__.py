"""KV memory pools and the prefix caches: the PrefixCache interface, the radix tree, and a cache of nothing."""

from plait.radix_cache.memory_pool import KVAllocator, KVPool, ReqToTokenPool
from plait.radix_cache.no_cache import NoCache
from plait.radix_cache.prefix_cache import CacheStats, MatchResult, PrefixCache
from plait.radix_cache.radix_cache import RadixCache, TreeNode

__all__ = ["KVAllocator", "KVPool", "ReqToTokenPool", "PrefixCache", "RadixCache", "NoCache", "TreeNode",
           "MatchResult", "CacheStats"]
