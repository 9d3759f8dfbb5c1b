"""Prefix reuse: a token-level radix tree over pool pages, isolation keys and eviction policies.

Plain Python, no torch: `PrefixCache` only decides which pages hold which prefixes; the scheduler
adopts them into page tables and storage applies the copy-on-write copies.
"""

from kvctl.agent.prefix.eviction import (
    EVICTION_POLICIES,
    EvictionOrder,
    EvictionPolicy,
    FirstInFirstOut,
    LeastFrequentlyUsed,
    LeastRecentlyUsed,
    make_policy,
)
from kvctl.agent.prefix.prefix_cache import (
    IsolationKey,
    PrefixCache,
    PrefixCacheCorrupted,
    PrefixCacheStats,
    PrefixIsolation,
    PrefixMatch,
)
from kvctl.agent.prefix.radix_tree import (
    PageOwners,
    RadixNode,
    RadixTree,
    RadixTreeCorrupted,
    TreeMatch,
)

__all__ = [
    "EVICTION_POLICIES",
    "EvictionOrder",
    "EvictionPolicy",
    "FirstInFirstOut",
    "IsolationKey",
    "LeastFrequentlyUsed",
    "LeastRecentlyUsed",
    "PageOwners",
    "PrefixCache",
    "PrefixCacheCorrupted",
    "PrefixCacheStats",
    "PrefixIsolation",
    "PrefixMatch",
    "RadixNode",
    "RadixTree",
    "RadixTreeCorrupted",
    "TreeMatch",
    "make_policy",
]
