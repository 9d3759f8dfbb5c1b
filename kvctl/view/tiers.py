"""The tiers below the device pool as operators read them: where reused prompt tokens came from,
how full each tier is, and whether its loads are cheaper than computing the prompt again.

One-shot views (`kvctl pool show`, `kvctl status`) have a single reading, so they show totals
since start and the load time per token next to the prefill time per token; the dashboard has
two readings and adds rates (`tier_rates`). An agent without tiers gets nothing at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.text import Text

from kvctl.units import format_bytes
from kvctl.view import fmt
from kvctl.view.untrusted import clean

if TYPE_CHECKING:
    from kvctl.api import PoolSnapshot, TierReading

DEVICE = "device"


def tier_names(pool: PoolSnapshot) -> list[str]:
    """The device, then the configured tiers in the order pages fall through them."""
    return [DEVICE, *(tier.tier for tier in pool.tiers)]


def hit_shares(by_tier: Mapping[str, float], names: Sequence[str]) -> dict[str, float | None]:
    """Each tier's share of the reused prompt tokens (device included); None when none were."""
    total = sum(by_tier.get(name, 0) for name in names)
    return {name: (by_tier.get(name, 0) / total if total else None) for name in names}


def failures(tier: TierReading) -> dict[str, int]:
    """The tier's non-zero failure counters as "store full", "load checksum", ..."""
    found = {f"store {clean(why)}": n for why, n in tier.store_failures_total.items() if n}
    found.update({f"load {clean(why)}": n for why, n in tier.load_failures_total.items() if n})
    return found


def failures_text(tier: TierReading) -> str:
    """The failures in one phrase, "store full 3, load checksum 2", for a row or a panel line."""
    return ", ".join(f"{what} {count:,}" for what, count in failures(tier).items())


def fill_ratio(used: int, capacity: int) -> float | None:
    """Used ÷ capacity; None for a tier that is off (0 pages), which is not "0 % full"."""
    return used / capacity if capacity else None


def versus_prefill(load: float | None, prefill: float | None, short: bool = False) -> Text:
    """How a tier's load time per token compares with computing the token: a tier whose loads
    cost more than prefill does not pay for itself, so that reads red. `short` leaves out
    "than prefill" (a column says it)."""
    if load is None or prefill is None or load <= 0:
        return Text("")
    ratio = prefill / load
    than = "" if short else " than prefill"
    if ratio >= 1:
        return Text(f"{_times(ratio)}× cheaper{than}", fmt.OK)
    return Text(f"{_times(1 / ratio)}× dearer{than}", fmt.BAD)


def _times(ratio: float) -> str:
    return f"{ratio:.2g}" if ratio < 9.95 else f"{ratio:,.0f}"


def tier_rows(pool: PoolSnapshot) -> list[tuple[str, Text]]:
    """Rows for the pool's key/value table: the split of reused tokens, then one row per tier
    (size, reuse, loads and their cost against prefill, failures when there are any). Empty
    when the agent has no tiers: nothing to show, not an empty section."""
    if not pool.tiers:
        return []
    names = tier_names(pool)
    shares = hit_shares(pool.prefix_hits_tokens_by_tier, names)
    split = ", ".join(f"{name} {fmt.percent(shares[name])}" for name in names)
    prefill = pool.prefill_seconds_per_token
    rows = [
        (
            "tiers",
            Text(
                f"reused {pool.prefix_hits_tokens_total:,} of "
                f"{pool.prefix_queries_tokens_total:,} prompt tokens since start: {split}; "
                + (
                    f"prefill {fmt.per_token(prefill)}/token"
                    if prefill is not None
                    else "prefill not timed yet (no prompt step of 64 tokens or more)"
                )
            ),
        )
    ]
    for tier in pool.tiers:
        rows.append((f"{tier.tier} tier", tier_text(tier, shares[tier.tier], pool)))
    return rows


def tier_text(tier: TierReading, share: float | None, pool: PoolSnapshot) -> Text:
    """One tier in a line: policy, used of capacity, where (disk), reuse, loads, failures."""
    text = Text(f"{clean(tier.policy)}; {capacity_text(tier)}")
    if tier.path is not None:
        text.append(f" in {clean(tier.path)}")
        if tier.filesystem_free_bytes is not None and tier.filesystem_size_bytes is not None:
            text.append(
                f" (filesystem {format_bytes(tier.filesystem_free_bytes)} free of "
                f"{format_bytes(tier.filesystem_size_bytes)})"
            )
    text.append(f"; reused {tier.hits_tokens_total:,} tokens ({fmt.percent(share)})")
    if tier.loaded_pages_total:
        text.append(
            f", loaded {tier.loaded_pages_total:,} pages ({format_bytes(tier.loaded_bytes_total)})"
            f" at {fmt.per_token(tier.load_seconds_per_token)}/token"
        )
        versus = versus_prefill(tier.load_seconds_per_token, pool.prefill_seconds_per_token)
        if versus:
            text.append(", ")
            text.append_text(versus)
    else:
        text.append(", nothing loaded yet", style=fmt.DIM)
    if failures(tier):
        text.append(f"; failures: {failures_text(tier)}", style=fmt.WARN)
    return text


def capacity_text(tier: TierReading) -> str:
    """ "391 of 1,024 pages, 24.4 MiB of 64 MiB (38 %)", or "off (0 pages)"."""
    if not tier.capacity_pages:
        return "off (0 pages)"
    full = fmt.percent(fill_ratio(tier.used_pages, tier.capacity_pages), 0)
    return (
        f"{tier.used_pages:,} of {tier.capacity_pages:,} pages, "
        f"{format_bytes(tier.used_bytes)} of {format_bytes(tier.capacity_bytes)} ({full})"
    )


# ---- rates between two readings (the dashboard) ---------------------------------------------


@dataclass(frozen=True)
class TierRates:
    """Per-second rates between two readings of one agent."""

    seconds: float
    hits_tokens: float
    """Prompt tokens reused per second, every tier (the device) included: prefill saved."""
    queries_tokens: float
    hits_by_tier: dict[str, float]
    loaded_bytes: dict[str, float]
    """Bytes per second read from each tier into the device."""


def tier_rates(older: PoolSnapshot, newer: PoolSnapshot) -> TierRates | None:
    """Rates from `older` to `newer` (by the agent's timestamps); None when no time passed or a
    counter went back (the agent restarted in between)."""
    seconds = newer.timestamp - older.timestamp
    if seconds <= 0:
        return None
    before = {tier.tier: tier for tier in older.tiers}
    pairs = [(before[tier.tier], tier) for tier in newer.tiers if tier.tier in before]
    counters = [
        (older.prefix_hits_tokens_total, newer.prefix_hits_tokens_total),
        (older.prefix_queries_tokens_total, newer.prefix_queries_tokens_total),
        *((a.loaded_bytes_total, b.loaded_bytes_total) for a, b in pairs),
    ]
    if any(after < first for first, after in counters):
        return None
    old_hits, new_hits = older.prefix_hits_tokens_by_tier, newer.prefix_hits_tokens_by_tier
    return TierRates(
        seconds=seconds,
        hits_tokens=(newer.prefix_hits_tokens_total - older.prefix_hits_tokens_total) / seconds,
        queries_tokens=(newer.prefix_queries_tokens_total - older.prefix_queries_tokens_total)
        / seconds,
        hits_by_tier={
            name: max(0, new_hits.get(name, 0) - old_hits.get(name, 0)) / seconds
            for name in tier_names(newer)
        },
        loaded_bytes={
            b.tier: (b.loaded_bytes_total - a.loaded_bytes_total) / seconds for a, b in pairs
        },
    )
