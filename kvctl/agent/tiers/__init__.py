"""KV tiers below the device pool: host memory, then files on disk, for evicted prefix pages.

`TieredStore` is what the prefix cache and the scheduler use; `TierIndex` orders a tier's pages
for eviction with the prefix cache's policies; `HostSlots` and `DiskSlots` hold the bytes.
"""

from kvctl.agent.tiers.disk_tier import LOAD_FAILURES, DiskPageError, DiskSlots
from kvctl.agent.tiers.host_tier import HostSlots
from kvctl.agent.tiers.tier_index import TierCorrupted, TierEntry, TierIndex
from kvctl.agent.tiers.tiered_store import (
    STORE_FAILURES,
    TIER_NAMES,
    TierCounters,
    TieredStore,
    TierHit,
    TierLoad,
    TierStats,
)

__all__ = [
    "LOAD_FAILURES",
    "STORE_FAILURES",
    "TIER_NAMES",
    "DiskPageError",
    "DiskSlots",
    "HostSlots",
    "TierCorrupted",
    "TierCounters",
    "TierEntry",
    "TierHit",
    "TierIndex",
    "TierLoad",
    "TierStats",
    "TieredStore",
]
