"""Scheduler and memory: requests running and waiting, preemptions, pool geometry, the pages in
sliding windows apart from the others, its share of a budget where the agent's pools share one,
GPU memory."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text
from textual.widget import Widget

from kvctl.api import PoolSnapshot
from kvctl.units import format_bytes
from kvctl.view import fmt, render
from kvctl.view.untrusted import clean

WIDE = 60
"""Columns from which the panel also shows token usage and residency (a 160-column screen)."""


class RequestsPanel(Widget):
    """What the scheduler is doing with the pool, and the GPU memory around it."""

    DEFAULT_CSS = """
    RequestsPanel { height: auto; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pool: PoolSnapshot | None = None

    def show(self, pool: PoolSnapshot | None) -> None:
        self.pool = pool
        self.refresh(layout=True)

    def render(self) -> RenderableType:
        pool = self.pool
        if pool is None:
            return Text("")
        lines = [
            Text.assemble(
                ("running ", "dim"),
                (f"{pool.requests_running}", "bold"),
                ("   waiting ", "dim"),
                (f"{pool.requests_waiting}", fmt.WARN if pool.requests_waiting else "bold"),
                ("   preemptions ", "dim"),
                (f"{pool.preemptions_total:,}", "bold"),
                (render.by_reason(pool.preemptions_by_reason_total), "dim"),
            ),
            Text(
                f"pool {clean(pool.pool)} on {clean(pool.device)}: "
                f"{fmt.pages(pool.capacity_pages, pool.bytes_per_page)}, {pool.segments} × "
                f"{pool.segment_pages}-page segments, {pool.page_size} tokens/page"
            ),
            Text(f"used {format_bytes(pool.used_bytes)}; defrag {render.defrag_summary(pool)}"),
        ]
        window = render.window_summary(pool)
        if window is not None:
            lines.append(Text(f"windows: {window}"))
        pins = render.pin_summary(pool)
        if pins is not None:
            lines.append(Text(f"pins: {pins}"))
        asleep = render.sleep_summary(pool)
        if asleep is not None:
            lines.append(Text(f"sleep: {asleep}", style=fmt.WARN))
        if self.size.width >= WIDE:  # on a narrow panel they would push the map off the screen
            lines.append(Text(f"tokens: {render.token_usage(pool)}"))
            residency = render.residency_summary(pool)
            if residency is not None:
                lines.append(Text(f"residency: {residency}"))
        share = share_line(pool, self.size.width)
        if share is not None:
            lines.append(share)
        lines.extend(self._gpus(pool))
        return Group(*lines)

    def _gpus(self, pool: PoolSnapshot) -> list[Text]:
        if not pool.gpus:
            device = clean(pool.device)
            return [Text(f"GPU memory: none measured on this host ({device})", style="dim")]
        return [
            Text.assemble(
                f"gpu{gpu.index} ", render.gpu_text(gpu.name, gpu.used_bytes, gpu.total_bytes)
            )
            for gpu in pool.gpus
        ]


def share_line(pool: PoolSnapshot, width: int) -> Text | None:
    """The pool's place in the budget it shares, in the longest form that fits one line of
    `width` cells; None where it shares none or no form fits (the budget bar above says the
    most of it, and `kvctl pool show` all of it)."""
    share = pool.share
    if share is None:
        return None
    of = fmt.percent(pool.capacity_bytes / share.budget_bytes if share.budget_bytes else None)
    moves = share.rebalances_total
    forms = [
        f"share {of} of {format_bytes(share.budget_bytes)}: floor {share.floor_pages:,}, "
        f"ceiling {share.ceiling_pages:,} pages, {share.reclaimable_pages:,} reclaimable"
        + f"; moves {moves.get('in', 0):,} in, {moves.get('out', 0):,} out",
        f"share {of} of {format_bytes(share.budget_bytes)}: floor {share.floor_pages:,}, "
        f"ceiling {share.ceiling_pages:,} pages, {share.reclaimable_pages:,} reclaimable",
    ]
    for form in forms:
        if len(form) <= width:
            return Text(form)
    return None
