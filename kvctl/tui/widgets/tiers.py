"""The tiers below the device: where reused prompt tokens come from, the prefill they save each
second, and each tier's fill and load rate. The detail screen shows it only for an agent that
has tiers, so an agent without them keeps the screen it always had."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.styled import Styled
from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from kvctl.api import PoolSnapshot, TierReading
from kvctl.units import format_bytes
from kvctl.view import fmt
from kvctl.view.tiers import (
    TierRates,
    fill_ratio,
    hit_shares,
    tier_names,
    versus_prefill,
)
from kvctl.view.tiers import failures as failure_counts
from kvctl.view.tiers import failures_text as failure_list
from kvctl.view.untrusted import safe

WIDE = 72
"""Columns from which the tiers are a table with a header, their used bytes, load cost per token
and its ratio to prefill; below, four lines hold the split, the saving and a line per tier."""
POLICY = 76
"""Columns from which the table also names each tier's eviction policy."""
SHORT = {"device": "dev"}


class TierPanel(Widget):
    """Hit split, prefill saved per second, and per tier: used of capacity and load rate."""

    DEFAULT_CSS = """
    TierPanel { height: auto; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pool: PoolSnapshot | None = None
        self.rates: TierRates | None = None
        self.stale = False

    def show(self, pool: PoolSnapshot | None, rates: TierRates | None, stale: bool) -> None:
        """Show `pool`'s tiers with `rates` between the readings of the last seconds."""
        self.pool, self.rates, self.stale = pool, rates, stale
        self.refresh(layout=True)

    def render(self) -> RenderableType:
        if self.pool is None or not self.pool.tiers:
            return Text("")
        lines = Group(*tier_lines(self.pool, self.rates, self.size.width or 80))
        return Styled(lines, "dim") if self.stale else lines


def tier_lines(pool: PoolSnapshot, rates: TierRates | None, width: int) -> list[RenderableType]:
    """The panel's lines for `width` columns: the split of reused tokens (over the rate window
    when tokens were reused in it, else since start), prefill saved per second, then the tiers:
    a table with prefill's cost and the failures when wide, a short line each when narrow."""
    wide = width >= WIDE
    names = tier_names(pool)
    recent = rates is not None and rates.hits_tokens > 0
    by_tier = (
        rates.hits_by_tier if rates is not None and recent else pool.prefix_hits_tokens_by_tier
    )
    shares = hit_shares(by_tier, names)
    split = Text("reused  " if wide else "reused ", style="dim")
    for index, name in enumerate(names):
        if index:
            split.append("   " if wide else " ")
        split.append(f"{name if wide else SHORT.get(name, name)} ")
        split.append(fmt.percent(shares[name], 1 if wide else 0), style="bold")
    if wide:
        span = (
            f"last {fmt.seconds(rates.seconds)}" if rates is not None and recent else "since start"
        )
        split.append(f"   ({span})", style="dim")
    saved = Text("saved   " if wide else "saved  ", style="dim")
    if rates is None:
        saved.append("–", style="dim")
    else:
        saved.append(fmt.token_rate(rates.hits_tokens), style="bold")
        if wide:
            below = sum(v for k, v in rates.hits_by_tier.items() if k != "device")
            saved.append(f" of prefill ({below:,.0f}/s from host and disk)", style="dim")
    lines: list[RenderableType] = [split, saved]
    if wide:
        lines.append(_wide_table(pool, rates, width))
        prefill = pool.prefill_seconds_per_token
        note = Text("prefill ", style="dim")
        note.append(fmt.per_token(prefill) if prefill is not None else "not timed yet")
        note.append(" a token; a tier pays while its loads cost less", style="dim")
        lines.append(note)
        for tier in pool.tiers:
            if failure_counts(tier):
                lines.append(Text(f"{tier.tier} failures: {failure_list(tier)}", style=fmt.WARN))
        return lines
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True, justify="right")
    grid.add_column(no_wrap=True)
    for tier in pool.tiers:
        loaded = rates.loaded_bytes.get(tier.tier) if rates is not None else None
        count = sum(failure_counts(tier).values())
        mark = Text(f"✖{count:,}", style=fmt.BAD) if count else Text("")
        grid.add_row(tier.tier, _used_narrow(tier), fmt.byte_rate(loaded), mark)
    lines.append(grid)
    return lines


def _wide_table(pool: PoolSnapshot, rates: TierRates | None, width: int) -> Table:
    """One row per tier under a header: used of size, how full, load rate, load time per token
    and how that compares with prefill."""
    table = Table(box=None, pad_edge=False, show_edge=False, padding=(0, 2, 0, 0))
    table.add_column("tier", style="bold", no_wrap=True)
    policy = width >= POLICY
    if policy:
        table.add_column("policy", no_wrap=True)
    table.add_column("used / size", no_wrap=True)
    table.add_column("full", no_wrap=True, justify="right")
    table.add_column("loads", no_wrap=True, justify="right")
    table.add_column("per token", no_wrap=True, justify="right")
    table.add_column("vs prefill", no_wrap=True)
    for tier in pool.tiers:
        loaded = rates.loaded_bytes.get(tier.tier) if rates is not None else None
        full = fill_ratio(tier.used_pages, tier.capacity_pages)
        table.add_row(
            tier.tier,
            *([safe(tier.policy)] if policy else []),
            _used_wide(tier),
            fmt.percent(full, 0),
            fmt.byte_rate(loaded),
            fmt.per_token(tier.load_seconds_per_token),
            versus_prefill(tier.load_seconds_per_token, pool.prefill_seconds_per_token, True),
        )
    return table


def _used_wide(tier: TierReading) -> Text:
    if not tier.capacity_pages:
        return Text("off", style="dim")
    return Text(f"{format_bytes(tier.used_bytes)} / {format_bytes(tier.capacity_bytes)}")


def _used_narrow(tier: TierReading) -> Text:
    if not tier.capacity_pages:
        return Text("off", style="dim")
    full = fmt.percent(fill_ratio(tier.used_pages, tier.capacity_pages), 0)
    return Text(f"{full:>5} of {format_bytes(tier.capacity_bytes)}")
