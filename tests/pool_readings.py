"""One builder of pool snapshots for the tests that need a reading without an agent.

A snapshot's ratios and byte counts are computed from its page counts (`PoolOccupancy`), so a
test names pages, not ratios, and a reading can never contradict itself. The base is a healthy
pool: 39 % held by running requests, half used with the cache, barely fragmented, every
allocation served, nothing waiting; no alert applies to it. It has no tier below the device;
`tier_reading` builds one (host memory, or page files on disk) to put in `tiers`.
"""

from __future__ import annotations

from typing import Any

from kvctl.api import PoolSnapshot, TierReading

QUIET: dict[str, Any] = dict(
    pool="demo",
    timestamp=1_700_000_000.0,
    device="cpu",
    page_size=16,
    bytes_per_page=65536,
    segment_pages=64,
    capacity_pages=512,
    used_pages=200,
    cached_pages=56,
    free_extents=2,
    max_pool_pages=None,
    alloc_attempts_total=1000,
    alloc_failures_total=0,
    alloc_success_ratio=1.0,
    window_seconds=300.0,
    prefix_cache_enabled=True,
    prefix_queries_tokens_total=10_000,
    prefix_hits_tokens_total=6_000,
    prefix_hit_ratio=0.6,
    prefix_evictions_total=0,
    defrag_runs_total={"manual": 0, "threshold": 0},
    defrag_pages_moved_total=0,
    defrag_active=False,
    last_defrag=None,
    last_defrag_age_seconds=None,
    auto_defrag_enabled=True,
    resizes_total={"grow": 0, "shrink": 0},
    requests_running=4,
    requests_waiting=0,
    preemptions_total=0,
    gpus=[],
    max_waiting=256,
    window_alloc_attempts=400,
    window_alloc_failures=0,
)


def pool_snapshot(*, fragmentation: float = 0.05, **fields: Any) -> PoolSnapshot:
    """The quiet pool with `fields` changed.

    Free pages default to what capacity, used and cached pages leave, and the largest free run
    to the one that gives `fragmentation` (as near as whole pages allow), unless given. With
    `tiers`, the hit tokens by tier default to each tier's own and the rest on the device.
    """
    merged = {**QUIET, **fields}
    merged.setdefault(
        "free_pages", merged["capacity_pages"] - merged["used_pages"] - merged["cached_pages"]
    )
    merged.setdefault("segments", merged["capacity_pages"] // merged["segment_pages"])
    free_run_pages = merged["free_pages"] - merged.get("reserved_pages", 0)
    merged.setdefault("largest_free_run", round(free_run_pages * (1.0 - fragmentation)))
    if merged.get("tiers"):  # hits split by tier: what the tiers loaded, the rest on the device
        below = {t.tier: t.hits_tokens_total for t in merged["tiers"]}
        device = merged["prefix_hits_tokens_total"] - sum(below.values())
        merged.setdefault("prefix_hits_tokens_by_tier", {"device": device, **below})
    return PoolSnapshot(**merged)


DISK_PATH = "/var/lib/kvctl/tier"
TIER_BYTES_PER_PAGE = {"host": 65536, "disk": 65536 + 48}  # a page file has a 48-byte header


def tier_reading(tier: str = "host", **fields: Any) -> TierReading:
    """An idle tier of 1,024 pages with nothing stored yet, with `fields` changed. A disk tier
    sits in `DISK_PATH` on a 1 TiB filesystem with 500 GiB free."""
    merged: dict[str, Any] = dict(
        tier=tier,
        policy="lru",
        capacity_pages=1024,
        used_pages=0,
        page_bytes=TIER_BYTES_PER_PAGE[tier],
        hits_tokens_total=0,
        stored_pages_total=0,
        stored_bytes_total=0,
        loaded_pages_total=0,
        loaded_bytes_total=0,
        store_seconds_total=0.0,
        load_seconds_total=0.0,
        evicted_pages_total=0,
        store_failures_total={"full": 0, "io": 0},
        load_failures_total={"missing": 0, "truncated": 0, "checksum": 0, "io": 0},
    )
    if tier == "disk":
        merged.update(
            path=DISK_PATH, filesystem_free_bytes=500 << 30, filesystem_size_bytes=1 << 40
        )
    merged.update(fields)
    return TierReading(**merged)
