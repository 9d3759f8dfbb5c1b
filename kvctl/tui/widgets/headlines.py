"""The four numbers an operator watches, each with its colour and a sparkline of its history."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text
from textual.widget import Widget

from kvctl.api import PoolSnapshot
from kvctl.tui.history import SERIES, WINDOWS, History, Window
from kvctl.tui.spark import sparkline
from kvctl.view import fmt


class Headlines(Widget):
    """Allocation success, fragmentation, utilisation, prefix hits: value over sparkline."""

    DEFAULT_CSS = """
    Headlines { height: 3; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pool: PoolSnapshot | None = None
        self.history: History | None = None
        self.stale = False
        self.now = 0.0
        self.window = WINDOWS[0]

    def show(
        self,
        pool: PoolSnapshot | None,
        history: History | None,
        stale: bool,
        now: float,
        window: Window,
    ) -> None:
        """Show `pool`'s numbers, and `history` over `window` ending at `now`."""
        self.pool, self.history, self.stale = pool, history, stale
        self.now, self.window = now, window
        self.refresh()

    def render(self) -> RenderableType:
        if self.pool is None:
            return Text("no reading yet", style="dim")
        column = max(8, self.size.width // len(SERIES))
        headlines = fmt.headlines(self.pool)
        labels, values, sparks = Text(), Text(), Text()
        for headline, name in zip(headlines, SERIES, strict=True):
            labels.append(headline.label.upper().ljust(column), style="dim")
            style = "dim" if self.stale else f"bold {headline.style}"
            values.append(headline.text.ljust(column), style=style)
            sparks.append(
                self._spark(name, column - 3).ljust(column), style="dim" if self.stale else "blue"
            )
        return Group(labels, values, sparks)

    def _spark(self, name: str, width: int) -> str:
        if self.history is None:
            return ""
        return sparkline(self.history.bars(name, width, self.now, self.window.seconds), width)
