"""The memory budget an agent's pools share, as one line: a bar split by pool, and its key."""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

from kvctl.fleet import Reading
from kvctl.units import format_bytes
from kvctl.view import budget

LEAST_BAR = 12
"""The fewest cells of the bar; the legend takes a shorter form before the bar gets fewer."""


class BudgetBar(Widget):
    """Budget, a bar of each pool's share (the shown pool bright), each pool's size and flags
    (pinned, under pressure), and what is free."""

    DEFAULT_CSS = """
    BudgetBar { height: 1; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reading: Reading | None = None
        self.shown: str | None = None

    def show(self, reading: Reading | None, shown: str | None) -> None:
        """`reading` of the whole agent (every pool), with pool `shown` on screen."""
        self.reading, self.shown = reading, shown
        self.refresh()

    def render(self) -> RenderableType:
        reading = self.reading
        if reading is None or not reading.every_pool:
            return Text("")
        return budget_line(reading, self.shown, self.size.width)


def budget_line(reading: Reading, shown: str | None, width: int) -> Text:
    """The bar's line at `width` cells: the legend in the fullest form that leaves the bar a
    quarter of the line (at least `LEAST_BAR` cells), the bar what the words leave."""
    pools = reading.every_pool
    total = budget.total_bytes(pools, reading.budget_bytes)
    head = Text.assemble(" budget ", (format_bytes(total), "bold"), " ")
    least = max(LEAST_BAR, width // 4)
    for form in range(budget.LEGENDS):
        tail = Text(" ") + budget.legend(pools, reading.budget_bytes, shown, form)
        if len(head) + 2 + least + len(tail) <= width:
            break
    cells = max(LEAST_BAR, width - len(head) - len(tail) - 2)
    line = head + Text("▕", "dim") + budget.bar(pools, reading.budget_bytes, cells, shown)
    line += Text("▏", "dim") + tail
    line.truncate(width, overflow="ellipsis")
    return line
