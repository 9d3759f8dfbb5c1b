"""Rich renderables of the API models: what `status`, `pool`, `defrag` and `alerts` print.

Pure functions from models to tables, so `kvctl top --once`, `--headless` and the commands
print the same thing and tests can render them without an agent.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvctl.units import format_bytes
from kvctl.view import budget, engine, fmt, tiers
from kvctl.view.untrusted import PROSE_LIMIT, clean, safe

if TYPE_CHECKING:
    from kvctl.api import (
        Alert,
        DefragResult,
        DurationBuckets,
        PoolRelease,
        PoolSnapshot,
        ResizeResult,
        TierReading,
    )
    from kvctl.fleet import Reading
    from kvctl.sizing import ResizePlan


def _pairs(title: str | None = None) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    if title:
        table.title = title
        table.title_justify = "left"
        table.title_style = "bold"
    return table


def headline_table(pool: PoolSnapshot) -> Table:
    """The four numbers, each in its colour, plus what they are made of."""
    table = _pairs()
    details = (
        f"{pool.window_alloc_attempts:,} attempts, {pool.window_alloc_failures:,} failed in the "
        f"last {fmt.seconds(pool.window_seconds)} ({pool.alloc_failures_total:,} failed of "
        f"{pool.alloc_attempts_total:,} since start)",
        f"{fmt.counted(pool.free_extents, 'free extent')}, largest free run "
        f"{fmt.counted(pool.largest_free_run, 'page')}",
        f"{pool.used_pages:,} used + {pool.cached_pages:,} cached of "
        f"{fmt.pages(pool.capacity_pages, pool.bytes_per_page)}",
        f"{pool.prefix_hits_tokens_total:,} of {pool.prefix_queries_tokens_total:,} prompt "
        f"tokens found, {pool.prefix_evictions_total:,} evictions",
    )
    for headline, detail in zip(fmt.headlines(pool), details, strict=True):
        table.add_row(
            headline.label, Text.assemble((headline.text, headline.style), "  ", (detail, "dim"))
        )
    return table


def pool_table(pool: PoolSnapshot) -> Table:
    """Geometry, requests and defragmentation of one pool, and its tiers when it has any."""
    table = _pairs()
    table.add_row("pool", Text(f"{clean(pool.pool)} on {clean(pool.device)}"))
    table.add_row(
        "capacity",
        f"{fmt.pages(pool.capacity_pages, pool.bytes_per_page)} in {pool.segments:,} segments "
        f"of {pool.segment_pages:,} pages; max "
        + ("unbounded" if pool.max_pool_pages is None else f"{pool.max_pool_pages:,} pages"),
    )
    table.add_row(
        "page",
        f"{pool.page_size} tokens, {format_bytes(pool.bytes_per_page)}; "
        f"{pool.free_pages:,} free ({format_bytes(pool.free_pages * pool.bytes_per_page)})",
    )
    table.add_row(
        "requests",
        f"{pool.requests_running} running, {pool.requests_waiting} waiting, "
        f"{pool.preemptions_total:,} preemptions{by_reason(pool.preemptions_by_reason_total)}",
    )
    table.add_row("tokens", token_usage(pool))
    residency = residency_summary(pool)
    if residency is not None:
        table.add_row("residency", residency)
    window = window_summary(pool)
    if window is not None:
        table.add_row("windows", window)
    pins = pin_summary(pool)
    if pins is not None:
        table.add_row("pins", pins)
    asleep = sleep_summary(pool)
    if asleep is not None:
        table.add_row("sleep", Text(asleep, style=fmt.WARN))
    table.add_row("defrag", Text(defrag_summary(pool)))
    grows, shrinks = pool.resizes_total.get("grow", 0), pool.resizes_total.get("shrink", 0)
    table.add_row("resizes", f"{grows} grows, {shrinks} shrinks")
    for gpu in pool.gpus:
        table.add_row(f"gpu{gpu.index}", gpu_text(gpu.name, gpu.used_bytes, gpu.total_bytes))
    for label, text in tiers.tier_rows(pool):
        table.add_row(label, text)
    for label, text in budget.share_rows(pool):
        table.add_row(label, text)
    return table


def window_summary(pool: PoolSnapshot) -> str | None:
    """The sliding-window pages apart from the others, for a model whose windows give pages
    back (None for one whose layers all share every page)."""
    if pool.page_groups <= 1 and not pool.window_released_pages_total:
        return None
    held = pool.window_pages
    return (
        f"{pool.page_groups} page tables per request; {held:,} used pages in sliding windows "
        f"({format_bytes(held * pool.bytes_per_page)}), {pool.window_released_pages_total:,} "
        "given back as windows moved on"
    )


def by_reason(counts: dict[str, int]) -> str:
    """' (growth 12, shrink 3)': the non-zero counts by reason, or nothing."""
    found = [f"{clean(reason)} {n:,}" for reason, n in counts.items() if n]
    return f" ({', '.join(found)})" if found else ""


def token_usage(pool: PoolSnapshot) -> str:
    """Usage counted in tokens beside usage counted in pages: they differ by the partly filled
    last pages and the pages taken ahead of their tokens ("–" from an agent that does not
    count tokens)."""
    slots = "–" if pool.token_slots_used is None else f"{pool.token_slots_used:,}"
    return (
        f"{fmt.percent(pool.token_usage_ratio)} of the token slots hold K/V ({slots}); "
        f"pages: {fmt.percent(pool.pressure_ratio)} used"
    )


def median_bucket(buckets: DurationBuckets | None) -> str:
    """The bucket holding the median observation, as '≤ 15s' ('> 1d' past the last bound);
    '–' with none."""
    if buckets is None or not buckets.cumulative or not buckets.cumulative[-1]:
        return "–"
    half = buckets.cumulative[-1] / 2
    for bound, count in zip(buckets.bounds, buckets.cumulative, strict=False):
        if count >= half:
            return f"≤ {fmt.seconds(bound)}"
    return f"> {fmt.seconds(buckets.bounds[-1])}"


def residency_summary(pool: PoolSnapshot) -> str | None:
    """Median page lifetime and idle time at eviction, median reuse gap, evictions by reason
    (None without a prefix cache)."""
    residency = pool.prefix_residency
    if not residency:
        return None
    evicted = by_reason(pool.prefix_evictions_by_reason_total)
    return (
        f"evicted pages lived {median_bucket(residency.get('lifetime'))} in the cache, idle "
        f"{median_bucket(residency.get('idle_before_eviction'))} before eviction{evicted}; hits "
        f"came {median_bucket(residency.get('reuse_gap'))} after the last use (medians)"
    )


def pin_summary(pool: PoolSnapshot) -> str | None:
    """The pinned prefixes and what they hold of the pool and of their cap (None without
    pins)."""
    if not pool.prefix_pins:
        return None
    held = pool.prefix_pinned_pages
    share = held / pool.capacity_pages if pool.capacity_pages else 0.0
    return (
        f"{pool.prefix_pins} pinned prefixes hold {held:,} pages ({share:.0%} of the pool, "
        f"{format_bytes(held * pool.bytes_per_page)}); the cap is "
        f"{pool.prefix_pin_cap_pages:,} (kvctl prefix ls)"
    )


def sleep_summary(pool: PoolSnapshot) -> str | None:
    """What a sleeping (or waking) model gave back and what wakes it (None when awake)."""
    state = pool.sleep
    if state.state == "awake":
        return None
    since = fmt.seconds(state.asleep_seconds or 0.0)
    weights = (
        f", its weights {'dropped' if state.level == 2 else 'in host memory'}"
        if state.level is not None
        else ""
    )
    if state.state == "waking":
        return f"waking (slept at level {state.level} for {since}){weights}; requests wait"
    model = clean(pool.pool)
    return (
        f"asleep at level {state.level} for {since}: {format_bytes(state.released_bytes)} "
        f"released{weights}; its next request or `kvctl wake --model {model}` wakes it"
    )


BUDGET_BAR = 60
"""Cells of the budget bar in the CLI's tables."""


def budget_table(
    pools: Sequence[PoolSnapshot],
    budget_bytes: int | None,
    assigned_bytes: int | None,
    width: int = BUDGET_BAR,
) -> Table:
    """The budget the pools share, and a bar of it split by pool with its legend."""
    table = _pairs()
    table.add_row("budget", budget.summary(pools, budget_bytes, assigned_bytes))
    table.add_row("", budget.bar(pools, budget_bytes, width))
    table.add_row("", budget.legend(pools, budget_bytes))
    return table


def pools_table(pools: Sequence[PoolSnapshot], budget_bytes: int | None) -> Table:
    """One row per pool of an agent: its size and share of the budget, the four numbers,
    requests, and what the rebalancer does with it."""
    table = Table(box=None, show_edge=False, pad_edge=False, padding=(0, _GAP // 2))
    table.add_column("pool", no_wrap=True, style="bold")
    table.add_column("capacity", justify="right", no_wrap=True)
    for column in ("of budget", "floor–ceiling", "util", "frag", "alloc ok", "prefix", "run/wait"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("rebalancing", no_wrap=True)
    total = budget.total_bytes(pools, budget_bytes)
    for pool in pools:
        success, frag, util, prefix = fmt.headlines(pool)
        share = pool.share
        table.add_row(
            safe(pool.pool),
            fmt.pages(pool.capacity_pages, pool.bytes_per_page),
            fmt.percent(pool.capacity_bytes / total if total else None),
            "–" if share is None else f"{share.floor_pages:,}–{share.ceiling_pages:,}",
            Text(util.text, style=util.style),
            Text(frag.text, style=frag.style),
            Text(success.text, style=success.style),
            Text(prefix.text, style=prefix.style),
            f"{pool.requests_running}/{pool.requests_waiting}",
            rebalancing_cell(pool),
        )
    return table


def rebalancing_cell(pool: PoolSnapshot) -> Text:
    """Pinned, under pressure or calm, then the moves in and out."""
    share = pool.share
    if share is None:
        return Text("–", style="dim")
    if share.pinned:
        text = Text("pinned", style=fmt.WARN)
    elif share.under_pressure:
        text = Text("under pressure", style=fmt.BAD)
    else:
        text = Text("calm", style=fmt.OK)
    moves = share.rebalances_total
    text.append(f"; {moves.get('in', 0):,} in, {moves.get('out', 0):,} out", style="dim")
    return text


def defrag_summary(pool: PoolSnapshot) -> str:
    state = "auto" if pool.auto_defrag_enabled else "manual only"
    runs = sum(pool.defrag_runs_total.values())
    plural = "" if runs == 1 else "s"
    text = f"{state}; {runs} run{plural}, {pool.defrag_pages_moved_total:,} pages moved"
    if pool.defrag_active:
        text += "; running now"
    if pool.last_defrag is not None:
        last = pool.last_defrag
        text += (
            f"; last ({clean(last.trigger)}, {fmt.seconds(pool.last_defrag_age_seconds)} ago) "
            f"{last.fragmentation_before:.2f} → {last.fragmentation_after:.2f}"
        )
    return text


def gpu_text(name: str, used: int, total: int) -> Text:
    ratio = used / total if total else 0.0
    style = fmt.BAD if ratio >= fmt.limits().gpu_memory_max else fmt.OK
    shown = f"{clean(name)}: {format_bytes(used)} of {format_bytes(total)} "
    return Text.assemble(shown, (fmt.percent(ratio), style))


def alerts_table(alerts: Sequence[Alert], now: float | None = None) -> RenderableType:
    """Firing and pending alerts, worst first, each with what to do about it (and the pool it
    is about, where they are about several pools of an agent)."""
    if not alerts:
        return Text("no alerts", style=fmt.OK)
    now = time.time() if now is None else now
    order = {"critical": 0, "warning": 1, "info": 2}
    pools = len({alert.labels.get("pool") for alert in alerts}) > 1
    table = Table(show_edge=False, expand=False, pad_edge=False)
    names = ("severity", "state", "alert", *(("pool",) if pools else ()), "for")
    for column in names:
        table.add_column(column, no_wrap=True)  # names whole: a broken name cannot be searched
    for column in ("summary", "remediation"):
        table.add_column(column, overflow="fold")
    for alert in sorted(alerts, key=lambda a: (a.state != "firing", order[a.severity], a.name)):
        style = fmt.severity_style(alert.severity) if alert.state == "firing" else "dim"
        table.add_row(
            Text(alert.severity, style=style),
            alert.state,
            safe(alert.name),
            *((safe(alert.labels.get("pool", "–")),) if pools else ()),
            fmt.seconds(max(0.0, now - alert.active_since)),
            safe(alert.summary, limit=PROSE_LIMIT),
            safe(alert.remediation, "bold", PROSE_LIMIT),
        )
    return table


def status_detail(reading: Reading) -> RenderableType:
    """One agent: identity, the four numbers, the pool, alerts; for an agent with several
    pools, the budget they share and one row per pool instead of one pool's numbers."""
    assert reading.pool is not None
    pool = reading.pool
    title = Text.assemble(("● up  ", fmt.OK), (clean(reading.agent), "bold"))
    if reading.health is not None:
        version, up = clean(reading.health.version), fmt.seconds(reading.health.uptime_seconds)
        title.append(f"  kvctl {version}, up {up}", style="dim")
    if reading.several:
        pools = reading.pools
        hint = Text(
            "kvctl pool show --pool NAME: one pool in full; pool map, pool resize, pool release "
            "and defrag --now take --pool NAME too",
            style="dim",
        )
        return Group(
            title,
            budget_table(pools, reading.budget_bytes, reading.assigned_bytes),
            pools_table(pools, reading.budget_bytes),
            hint,
            alerts_table(reading.alerts),
        )
    return Group(title, headline_table(pool), pool_table(pool), alerts_table(reading.alerts))


WIDE_FLEET = 120
"""Columns from which the fleet table also shows each pool's name and capacity; below, the four
numbers keep their room and the agent and alert names give way, cut with an ellipsis."""

_NUMBERS = {"util": 6, "frag": 4, "alloc ok": 8, "prefix": 6, "preempt": 7, "run/wait": 8}
_NARROW_NUMBERS = {key: width for key, width in _NUMBERS.items() if key != "preempt"}
_GAP = 2  # spaces between two columns
MIN_ALERTS = 16
"""The alerts column's width before the agent's name gives way (a node is found by its name
first); on a narrow terminal the two share what is left."""


class FleetTable:
    """The fleet table, laid out for the width it is printed at (80 columns included)."""

    def __init__(self, readings: Sequence[Reading]) -> None:
        self.readings = readings

    def __rich_console__(
        self, console: Console, options: ConsoleOptions
    ) -> Iterator[RenderableType]:
        yield fleet_table(self.readings, width=options.max_width)


def fleet_table(readings: Sequence[Reading], width: int = WIDE_FLEET) -> Table:
    """One row per agent and pool; an agent that did not answer is a row with the reason.
    Alert names are one a line and never folded: a name cut in two reads as two names and
    cannot be searched for. The numbers keep their room at any width; the agent and alert
    columns share what is left, cut with an ellipsis."""
    wide = width >= WIDE_FLEET
    shown = [row for reading in readings for row in reading.per_pool()]
    rows = [fleet_row(reading) for reading in shown]
    named = wide or len({reading.agent for reading in shown}) < len(shown)
    if not wide:  # no capacity or preemptions; the pool's name alone, where there are several
        rows = [
            row[:2] + ((_pool_name(reading),) if named else ()) + row[4:8] + row[9:]
            for row, reading in zip(rows, shown, strict=True)
        ]
    numbers = {"capacity": 9, **_NUMBERS} if wide else _NARROW_NUMBERS
    if wide and any(reading.source == "prometheus" for reading in shown):
        # from Prometheus a count over the last 5m; read directly, one since the node started
        numbers = {("preempt 5m" if k == "preempt" else k): w for k, w in numbers.items()}
    state = 5
    pool = 0
    if named:  # an engine's model name can be long: at most a sixth of the width
        pool = min(max((len(str(row[2])) for row in rows), default=4), max(12, width // 6))
        rows = [(row[0], row[1], _cut(row[2], pool), *row[3:]) for row in rows]
    left = width - state - sum(max(w, len(c)) for c, w in numbers.items())
    left -= _GAP * (len(numbers) + 2 + named) + pool
    # the agent's name is whole where it fits beside the shortest alerts column, and depends on
    # the agents alone, so the columns stay put from one frame to the next as alerts come and go
    longest = max((len(str(row[0])) for row in rows), default=8)
    agent = max(8, min(longest, max(left // 2, left - MIN_ALERTS)))
    alerts = max(6, left - agent)
    rows = [
        (_cut(row[0], agent), *row[1:-1], _last_cell(row[-1], alerts, reading.up))
        for row, reading in zip(rows, shown, strict=True)
    ]
    table = Table(box=None, show_edge=False, pad_edge=False, padding=(0, _GAP // 2))
    table.add_column("agent", no_wrap=True, width=agent)
    table.add_column("state", no_wrap=True, width=state)
    if named:
        table.add_column("pool", no_wrap=True, width=max(4, pool))
    for column, least in numbers.items():
        table.add_column(column, justify="right", no_wrap=True, min_width=max(least, len(column)))
    table.add_column("alerts", no_wrap=True, width=alerts)
    for row in rows:
        table.add_row(*row)
    return table


def _last_cell(cell: RenderableType, width: int, up: bool) -> RenderableType:
    """Alert names cut to `width` (one a line, never folded); a down node's reason folded over
    as many lines as it takes, never cut: it is the one thing its row says."""
    if up or not isinstance(cell, Text):
        return _cut(cell, width)
    lines = textwrap.wrap(cell.plain, width, break_on_hyphens=False) or [""]
    return Text("\n".join(lines), style=cell.style)


def _pool_name(reading: Reading) -> Text:
    return safe(reading.row_name or "–")


def _cut(cell: RenderableType, width: int) -> RenderableType:
    """Every line of a text cell at most `width` cells, cut with an ellipsis."""
    text = Text(cell) if isinstance(cell, str) else cell
    if not isinstance(text, Text):
        return cell
    lines = text.split("\n")
    for line in lines:
        line.truncate(width, overflow="ellipsis")
    return Text("\n").join(lines)


def fleet_row(reading: Reading) -> tuple[RenderableType, ...]:
    """agent, state, pool, capacity, util, frag, alloc ok, prefix, preempt, run/wait, alerts;
    "–" where the node's source exports no such figure."""
    figures = reading.row_figures
    if not reading.up or figures is None:
        reason = clean(reading.error.reason, PROSE_LIMIT) if reading.error else "no answer"
        blank = ("–",) * 8
        agent = safe(reading.agent)
        return (agent, Text("DOWN", style=fmt.BAD), *blank, Text(reason, style=fmt.BAD))
    success, frag, util, prefix = fmt.figure_headlines(figures)
    awake = reading.pool is None or reading.pool.sleep.state == "awake"
    return (
        safe(reading.agent),
        Text("up", style=fmt.OK) if awake else Text("sleep", style=fmt.WARN),  # or waking
        engine.row_label(reading),
        engine.capacity_text(reading),
        Text(util.text, style=util.style),
        Text(frag.text, style=frag.style),
        Text(success.text, style=success.style),
        Text(prefix.text, style=prefix.style),
        fmt.count(figures.preemptions),
        f"{fmt.count(figures.requests_running)}/{fmt.count(figures.requests_waiting)}",
        _alerts_of(reading),
    )


def _alerts_of(reading: Reading) -> Text:
    """The node's alerts; "–" where none were read (an engine's /metrics carries none)."""
    if not reading.alerts_read:
        return Text("–", style=fmt.DIM)
    return alerts_cell(reading.alerts)


def alerts_cell(alerts: Sequence[Alert]) -> Text:
    """Every alert by name, one a line: firing ones first in their severity's colour, then
    pending ones dimmed and marked (a count alone would not say which to look up)."""
    if not alerts:
        return Text("none", style=fmt.OK)
    ordered = sorted(alerts, key=lambda a: a.state != "firing")
    text = Text()
    for index, alert in enumerate(ordered):
        if index:
            text.append("\n")
        if alert.state == "firing":
            text.append(clean(alert.name), style=fmt.severity_style(alert.severity))
        else:
            text.append(f"{clean(alert.name)} (pending)", style="dim")
    return text


def status(readings: Sequence[Reading]) -> RenderableType:
    """One agent in detail, or a fleet as a table."""
    if len(readings) == 1 and readings[0].up:
        if readings[0].pool is None:
            return engine.detail(readings[0])
        return status_detail(readings[0])
    return FleetTable(readings)


def defrag_state(pool: PoolSnapshot, named: bool = False) -> Table:
    """Fragmentation now and what the defragmenter has done so far (`named`: the hint names
    the pool, one of several on its agent)."""
    table = _pairs()
    style = fmt.fragmentation_style(pool.fragmentation_ratio)
    table.add_row(
        "fragmentation",
        Text.assemble(
            (f"{pool.fragmentation_ratio:.2f}", style),
            f"  {fmt.counted(pool.free_extents, 'free extent')}, largest free run "
            f"{fmt.counted(pool.largest_free_run, 'page')}",
        ),
    )
    table.add_row("defrag", Text(defrag_summary(pool)))
    command = "kvctl defrag --now" + (f" --pool {clean(pool.pool)}" if named else "")
    table.add_row("hint", Text(f"{command} compacts the pool now", style="dim"))
    return table


def defrag_result(result: DefragResult, pool: str | None = None) -> Table:
    """What a defragmentation did (to pool `pool`, when one was named)."""
    table = _pairs()
    if pool is not None:
        table.add_row("pool", safe(pool))
    style = fmt.fragmentation_style(result.fragmentation_after)
    table.add_row(
        "fragmentation",
        Text.assemble(
            f"{result.fragmentation_before:.2f} → ", (f"{result.fragmentation_after:.2f}", style)
        ),
    )
    table.add_row("free extents", f"{result.free_extents_before:,} → {result.free_extents_after:,}")
    table.add_row("moved", f"{result.pages_moved:,} pages ({format_bytes(result.bytes_moved)})")
    table.add_row("took", fmt.seconds(result.seconds))
    if not result.complete:
        table.add_row(
            "note", Text("stopped early (--max-pages); run again to go on", style=fmt.WARN)
        )
    return table


def resize_plan(agent: str, plan: ResizePlan) -> str:
    line = (
        f"{clean(agent)}: {plan.old_pages:,} pages ({format_bytes(plan.old_bytes)}) → "
        f"{plan.new_pages:,} pages ({format_bytes(plan.new_bytes)})"
    )
    return f"{line}; {rounding_note(plan)}" if plan.rounded else line


def rounding_note(plan: ResizePlan) -> str:
    """Why the size differs from what was asked: pools change by whole segments."""
    note = (
        f"{plan.asked_pages:,} pages asked, rounded up to whole segments of "
        f"{plan.segment_pages:,} pages"
    )
    if plan.new_pages == plan.old_pages:
        note += f", so nothing changes (change it by at least {plan.segment_pages:,} pages)"
    return note


def tier_resize_plan(agent: str, pool: PoolSnapshot, tier: TierReading, plan: ResizePlan) -> str:
    """A tier's resize as the confirmation shows it, with what happens to the pages it holds:
    those that no longer fit go to the tier below, or are dropped from the last one."""
    line = (
        f"{clean(agent)} {tier.tier} tier: {plan.old_pages:,} pages "
        f"({format_bytes(plan.old_bytes)}) → {plan.new_pages:,} pages "
        f"({format_bytes(plan.new_bytes)})"
    )
    notes = []
    if plan.new_pages == plan.old_pages:
        notes.append("nothing changes")
    elif plan.new_pages == 0:
        notes.append("turns the tier off")
    leaving = tier.used_pages - plan.new_pages
    if leaving > 0:
        below = [t for t in pool.tiers if t.tier != tier.tier and t.tier == "disk"]
        to = (
            "go to the disk tier"
            if tier.tier == "host" and below and below[0].capacity_pages
            else "are dropped"
        )
        notes.append(f"{leaving:,} of the {tier.used_pages:,} pages it holds {to}")
    free = tier.filesystem_free_bytes
    growth = plan.new_bytes - plan.old_bytes
    if free is not None and growth > free:
        notes.append(f"more than the {format_bytes(free)} free on its filesystem")
    return "; ".join([line, *notes])


def resize_result(result: ResizeResult, pool: str | None = None) -> Table:
    """What a resize did (to pool `pool`, when one was named), and the pin it left on a pool
    that shares a budget."""
    table = _pairs()
    device = result.tier == "device"
    if pool is not None:
        table.add_row("pool", safe(pool))
    table.add_row(
        result.direction if device else f"{result.tier} tier {result.direction}",
        f"{result.old_pages:,} pages ({format_bytes(result.old_bytes)}) → "
        f"{result.new_pages:,} pages ({format_bytes(result.new_bytes)})",
    )
    if not device:
        if result.pages_evicted:
            table.add_row(
                "evicted", f"{result.pages_evicted:,} pages, to the tier below or dropped"
            )
    elif result.pages_moved or result.pages_evicted:
        table.add_row("moved", f"{result.pages_moved:,} pages, {result.pages_evicted:,} evicted")
    if result.pinned:
        release = "kvctl pool release" + ("" if pool is None else f" --pool {clean(pool)}")
        table.add_row(
            "pinned",
            Text.assemble(
                ("now pinned", fmt.WARN),
                ": the agent moves no memory in or out of this pool until ",
                (release, "bold"),
                " hands it back",
            ),
        )
    return table


def release_result(result: PoolRelease) -> Text:
    """What releasing a pool did: the pin is gone, or there was none."""
    if result.was_pinned:
        return Text.assemble(
            (f"pool {clean(result.pool)} released", fmt.OK),
            ": the agent may move memory in and out of it again",
        )
    return Text(f"pool {clean(result.pool)} was not pinned; nothing changed", style="dim")


def sizing_table(pool: PoolSnapshot, context: int | None, requests: int = 8) -> Table:
    """What the pool holds in requests, and the size that would hold the model's full context
    for `requests` at once: `kvctl simulate`'s question, answered from one snapshot."""
    from kvctl.sizing import PoolFit

    fit = PoolFit(
        pool.page_size, pool.bytes_per_page, pool.capacity_pages, context, pool.page_groups
    )
    table = _pairs()
    finished = sum(pool.requests_finished_total.values())
    mean = (pool.prompt_tokens_total + pool.generation_tokens_total) // finished if finished else 0
    holds = [f"{fit.tokens:,} tokens"]
    if context is not None:
        full = fmt.counted(fit.concurrent(context), "request")
        holds.append(f"{full} of the full {context:,}-token context")
    if mean:
        holds.append(f"{fit.concurrent(mean):,} of {mean:,} tokens (the mean so far)")
    table.add_row("holds", ", ".join(holds))
    limit = "the model's context" if fit.largest_request == context else "the pool"
    largest = Text(f"{fit.largest_request:,} tokens (prompt + max_tokens; {limit})")
    if fit.short_of_context:
        largest.stylize(fmt.BAD)
    table.add_row("largest request", largest)
    if context is None:
        table.add_row("to hold", Text("the model's context is unknown (not in /v1/models)", "dim"))
        return table
    pages = fit.pages_for_contexts(requests)
    pages = -(-pages // pool.segment_pages) * pool.segment_pages  # resizes are whole segments
    several = pool.share is not None and pool.share.pools_total > 1
    text = (
        f"{requests} full contexts at once: {fmt.pages(pages, pool.bytes_per_page)}; "
        f"kvctl pool resize --pages {pages}" + (f" --pool {clean(pool.pool)}" if several else "")
    )
    if pool.share is not None and pages > pool.share.ceiling_pages:
        text += (
            f" (above its ceiling of {pool.share.ceiling_pages:,} in the "
            f"{format_bytes(pool.share.budget_bytes)} budget: restart with a larger --kv-budget)"
        )
    elif pool.max_pool_pages is not None and pages > pool.max_pool_pages:
        text += f" (above the max of {pool.max_pool_pages:,}: restart with --max-pool-pages)"
    table.add_row("to hold", Text(text))
    return table
