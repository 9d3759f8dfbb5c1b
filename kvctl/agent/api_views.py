"""The one place where the core's readings become the API's models.

The pool core (`kvctl.agent.pool`, `kvctl.agent.prefix`, `kvctl.agent.budget`) returns plain
frozen dataclasses and knows nothing of pydantic or of `kvctl.api` (ruff's banned-api rules in
their `ruff.toml` keep it so); the tiers return theirs. The agent builds every wire object from
them here: a change of the core's data structures stops at this module, and the JSON keeps its
shape (field names and order are the API models'; the ratios are computed by the same functions,
`kvctl.occupancy`, on both sides).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvctl import api
from kvctl.agent.pool import DefragReport, PoolOccupancy
from kvctl.agent.prefix.prefix_cache import CachedPrefix
from kvctl.agent.prefix.residency import Residency
from kvctl.agent.runtime.prefix_ops import PrefixLookup
from kvctl.agent.runtime.prefix_pins import PrefixPin
from kvctl.agent.tiers import TierStats

_TIER_NAMES: dict[str, api.TierName] = {"host": "host", "disk": "disk"}


def occupancy_fields(reading: PoolOccupancy) -> dict[str, Any]:
    """The pool's reading as the keyword arguments of `api.PoolOccupancy` (and so of the first
    part of an `api.PoolSnapshot`): every field, none of the derived figures, which the model
    computes."""
    return {f.name: getattr(reading, f.name) for f in fields(reading)}


def occupancy_view(reading: PoolOccupancy) -> api.PoolOccupancy:
    """The API's model of a pool's occupancy reading."""
    return api.PoolOccupancy(**occupancy_fields(reading))


def defrag_view(report: DefragReport) -> api.DefragResult:
    """The API's model of what one defragmentation (or session of them) did."""
    carried = {f.name: getattr(report, f.name) for f in fields(report)}
    return api.DefragResult(**carried | {"trigger": report.trigger.value})


def tier_name(name: str) -> api.TierName:
    """A tier's name as the API spells it; ValueError for one the API does not know."""
    try:
        return _TIER_NAMES[name]
    except KeyError:
        raise ValueError(f"no tier named {name!r}; the tiers are {sorted(_TIER_NAMES)}") from None


def tier_view(stats: TierStats) -> api.TierReading:
    """The API's reading of one tier below the device pool."""
    counters = stats.counters
    free, size = stats.filesystem if stats.filesystem is not None else (None, None)
    return api.TierReading(
        tier=tier_name(stats.name),
        policy=stats.policy,
        capacity_pages=stats.capacity_pages,
        used_pages=stats.used_pages,
        page_bytes=stats.page_bytes,
        hits_tokens_total=counters.hits_tokens,
        stored_pages_total=counters.stored_pages,
        stored_bytes_total=counters.stored_bytes,
        loaded_pages_total=counters.loaded_pages,
        loaded_bytes_total=counters.loaded_bytes,
        store_seconds_total=counters.store_seconds,
        load_seconds_total=counters.load_seconds,
        evicted_pages_total=counters.evicted_pages,
        store_failures_total=dict(counters.store_failures),
        load_failures_total=dict(counters.load_failures),
        path=stats.path,
        filesystem_free_bytes=free,
        filesystem_size_bytes=size,
    )


def residency_view(residency: Residency) -> dict[str, api.DurationBuckets]:
    """The prefix cache's residency counts as the snapshot's histograms."""
    named = {
        "lifetime": residency.lifetime,
        "idle_before_eviction": residency.idle_before_evict,
        "reuse_gap": residency.reuse_gap,
    }
    views = {}
    for name, counts in named.items():
        cumulative, total = counts.cumulative()
        views[name] = api.DurationBuckets(
            bounds=list(counts.bounds), cumulative=list(cumulative), sum=total
        )
    return views


def lookup_view(model: str, found: PrefixLookup) -> api.PrefixLookupResult:
    return api.PrefixLookupResult(
        model=model,
        cache_salt=found.salt,
        prompt_tokens=found.prompt_tokens,
        device_tokens=found.device_tokens,
        device_pages=found.device_pages,
        tier_tokens=found.tier_tokens,
        last_used_at=found.last_used_at,
        pins=found.pins,
    )


def pin_view(model: str, pin: PrefixPin, preview: str) -> api.PrefixPinView:
    return api.PrefixPinView(
        id=pin.pin_id,
        model=model,
        cache_salt=pin.salt,
        tokens=pin.tokens,
        pages=pin.pages,
        created_at=pin.created_at,
        expires_at=pin.expires_at,
        preview=preview,
    )


def cached_prefix_view(model: str, prefix: CachedPrefix, preview: str) -> api.CachedPrefixView:
    return api.CachedPrefixView(
        model=model,
        cache_salt=prefix.key.salt,
        tokens=len(prefix.tokens),
        pages=prefix.pages,
        last_used_at=prefix.last_used_at,
        preview=preview,
    )


def resize_direction(old_pages: int, new_pages: int) -> api.ResizeDirection:
    """grow, shrink or none: how a capacity changed."""
    if new_pages > old_pages:
        return "grow"
    return "shrink" if new_pages < old_pages else "none"


def resize_view(
    old_pages: int,
    new_pages: int,
    page_bytes: int,
    *,
    pages_moved: int = 0,
    pages_evicted: int = 0,
    tier: str = "device",
    pool: str | None = None,
) -> api.ResizeResult:
    """The API's account of a resize of the device pool (or of the tier named) of model `pool`
    from `old_pages` to `new_pages` pages of `page_bytes` each."""
    return api.ResizeResult(
        old_pages=old_pages,
        new_pages=new_pages,
        old_bytes=old_pages * page_bytes,
        new_bytes=new_pages * page_bytes,
        direction=resize_direction(old_pages, new_pages),
        pages_moved=pages_moved,
        pages_evicted=pages_evicted,
        tier="device" if tier == "device" else tier_name(tier),
        pool=pool,
    )
