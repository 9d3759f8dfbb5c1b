"""The memory budget an agent's pools share (several models on one agent): a bar split by pool,
its legend, and where each pool stands in it.

Pure functions of the API's models, shared by `kvctl pool show`, `kvctl status` and the
dashboard's budget bar. Each pool has a glyph as well as a colour, so the split reads the same
where there is no colour (a log, a snapshot, a pipe).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.text import Text

from kvctl.units import format_bytes
from kvctl.view import fmt
from kvctl.view.untrusted import clean

if TYPE_CHECKING:
    from kvctl.api import PoolSnapshot

GLYPHS = ("█", "▓", "▒")
COLOURS = ("blue", "green", "yellow", "magenta", "cyan", "red")
FREE = "░"


def total_bytes(pools: Sequence[PoolSnapshot], budget_bytes: int | None) -> int:
    """The budget, or what the pools hold together where there is none."""
    return budget_bytes or sum(pool.capacity_bytes for pool in pools)


def pool_style(index: int) -> tuple[str, str]:
    """The glyph and colour of the pool at `index` (the order the agent lists them)."""
    return GLYPHS[index % len(GLYPHS)], COLOURS[index % len(COLOURS)]


def split(sizes: Sequence[int], total: int, width: int) -> list[int]:
    """`width` cells shared out in proportion to `sizes` of `total`, the last share being what
    is left of `total` (largest remainders first, so the cells add up to `width`); a size above
    zero gets at least one cell while there are cells to give."""
    parts = [*sizes, max(0, total - sum(sizes))]
    whole = sum(parts)
    if width <= 0 or whole <= 0:
        return [0] * len(parts)
    exact = [part * width / whole for part in parts]
    cells = [int(value) for value in exact]
    by_remainder = sorted(range(len(parts)), key=lambda i: exact[i] - cells[i], reverse=True)
    for index in by_remainder[: width - sum(cells)]:
        cells[index] += 1
    for index, part in enumerate(parts):
        if part and not cells[index]:
            donor = max(range(len(cells)), key=lambda i: cells[i])
            if cells[donor] > 1:
                cells[donor] -= 1
                cells[index] = 1
    return cells


def bar(
    pools: Sequence[PoolSnapshot],
    budget_bytes: int | None,
    width: int,
    shown: str | None = None,
) -> Text:
    """The budget as `width` cells: each pool's capacity in its glyph and colour (the pool
    `shown` bright, the others dimmed), then what no pool holds."""
    total = total_bytes(pools, budget_bytes)
    cells = split([pool.capacity_bytes for pool in pools], total, width)
    text = Text()
    for index, (pool, count) in enumerate(zip(pools, cells, strict=False)):
        glyph, colour = pool_style(index)
        text.append(glyph * count, style=colour if shown in (None, pool.pool) else f"dim {colour}")
    text.append(FREE * cells[-1], style="bright_black")
    return text


def flags(pool: PoolSnapshot, short: bool = False) -> str:
    """What sets the pool apart in its budget: "pinned", "under pressure" ("pressure" when
    `short`), or nothing."""
    share = pool.share
    if share is None:
        return ""
    words = ["pinned"] if share.pinned else []
    if share.under_pressure:
        words.append("pressure" if short else "under pressure")
    return ", ".join(words)


LEGENDS = 4
"""How many forms `legend` has, from the fullest (0) to the shortest."""


def legend(
    pools: Sequence[PoolSnapshot],
    budget_bytes: int | None,
    shown: str | None = None,
    form: int = 0,
) -> Text:
    """The key to `bar`: each pool's glyph, name, bytes and flags, then what is free. Shorter
    `form`s give way in order: words (1), pool sizes (2), flags and the free bytes (3)."""
    text = Text()
    for index, pool in enumerate(pools):
        glyph, colour = pool_style(index)
        if index:
            text.append("  ")
        text.append(f"{glyph} ", style=colour)
        name_style = "bold underline" if pool.pool == shown and len(pools) > 1 else "bold"
        text.append(clean(pool.pool), style=name_style)
        if form < 2:
            text.append(f" {format_bytes(pool.capacity_bytes)}")
        if form < 3 and (flagged := flags(pool, short=form > 0)):
            text.append(f" {flagged}", style=fmt.WARN)
    free = total_bytes(pools, budget_bytes) - sum(pool.capacity_bytes for pool in pools)
    text.append(f"  {FREE}", style="bright_black")
    if form < 3:
        text.append(f" {format_bytes(max(0, free))}" + (" free" if form == 0 else ""), "dim")
    return text


def summary(
    pools: Sequence[PoolSnapshot], budget_bytes: int | None, assigned_bytes: int | None
) -> str:
    """ "12 MiB shared by 2 pools: 12 MiB assigned, 0 B unassigned"."""
    total = total_bytes(pools, budget_bytes)
    assigned = sum(p.capacity_bytes for p in pools) if assigned_bytes is None else assigned_bytes
    plural = "" if len(pools) == 1 else "s"
    return (
        f"{format_bytes(total)} shared by {len(pools)} pool{plural}: "
        f"{format_bytes(assigned)} assigned, {format_bytes(max(0, total - assigned))} unassigned"
    )


def share_rows(pool: PoolSnapshot) -> list[tuple[str, Text]]:
    """The pool's place in its budget as (label, text) rows; none for a pool without one."""
    share = pool.share
    if share is None:
        return []
    of = share.budget_bytes and pool.capacity_bytes / share.budget_bytes
    rows = [
        (
            "share",
            Text(
                f"{format_bytes(pool.capacity_bytes)} of the {format_bytes(share.budget_bytes)} "
                f"budget ({fmt.percent(of)}); floor {share.floor_pages:,} pages, "
                f"ceiling {share.ceiling_pages:,} pages"
            ),
        )
    ]
    if share.pinned:
        pinned = Text.assemble(
            ("yes", fmt.WARN),
            ": the agent moves no memory in or out of it; ",
            (f"kvctl pool release --pool {clean(pool.pool)}", "bold"),
            " hands it back",
        )
    else:
        pinned = Text("no: the agent moves memory in and out of it as the pools need")
    rows.append(("pinned", pinned))
    if share.under_pressure:
        short = f", {share.short_pages:,} pages short" if share.short_pages else ""
        pressure = Text(f"under pressure{short}", style=fmt.BAD)
    else:
        pressure = Text("none", style=fmt.OK)
    pressure.append(f"; {share.reclaimable_pages:,} pages reclaimable")
    rows.append(("pressure", pressure))
    rows.append(("rebalances", Text(rebalances(pool))))
    return rows


def rebalances(pool: PoolSnapshot) -> str:
    """Moves into and out of the pool with their bytes: "2 in (+2 MiB), 1 out (−1 MiB)", or
    "none yet"."""
    share = pool.share
    if share is None:
        return "–"
    moves, moved = share.rebalances_total, share.rebalanced_bytes_total
    took, gave = moved.get("in", 0), moved.get("out", 0)
    if not any(moves.values()):
        return "none yet"
    return (
        f"{moves.get('in', 0):,} in (+{format_bytes(took)}), "
        f"{moves.get('out', 0):,} out (−{format_bytes(gave)})"
    )
