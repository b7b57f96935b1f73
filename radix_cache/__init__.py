"""KV memory pools and the radix-tree prefix cache."""

from plait.radix_cache.memory_pool import KVAllocator, KVPool, ReqToTokenPool
from plait.radix_cache.no_cache import NoCache
from plait.radix_cache.radix_cache import MatchResult, RadixCache, TreeNode

__all__ = ["KVAllocator", "KVPool", "ReqToTokenPool", "RadixCache", "NoCache", "TreeNode", "MatchResult"]
