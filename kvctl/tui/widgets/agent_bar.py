"""Which agent is shown, whether it answers, and since when it has not."""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

from kvctl.fleet import Reading
from kvctl.view import fmt
from kvctl.view.untrusted import PROSE_LIMIT, clean


class AgentBar(Widget):
    """One line: agent n/N, its pool (n/N where it has several) and uptime, or the reason it is
    not answering."""

    DEFAULT_CSS = """
    AgentBar { height: auto; background: $boost; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.text = Text("connecting…", style="dim")

    def show(
        self,
        position: tuple[int, int],
        reading: Reading,
        last_good_age: float | None,
        interval: float,
        readonly: bool,
        pool_position: tuple[int, int] | None = None,
    ) -> None:
        """`pool_position` (n, N): the pool shown is the n-th (from 0) of the agent's N."""
        index, count = position
        text = Text.assemble(
            (f" agent {index + 1}/{count} ", "reverse"), " ", (clean(reading.agent), "bold")
        )
        if reading.up and reading.pool is not None:
            text.append(f"  pool {clean(reading.pool.pool)}", style="dim")
            if pool_position is not None:
                shown, pools = pool_position
                text.append(f" ({shown + 1}/{pools}, p next)", style="dim")
            text.append(f" on {clean(reading.pool.device)}", style="dim")
            if reading.health is not None:
                text.append(f"  up {fmt.seconds(reading.health.uptime_seconds)}", style="dim")
        else:
            seen = (
                "never answered"
                if last_good_age is None
                else f"last answer {fmt.seconds(last_good_age)} ago"
            )
            reason = clean(reading.error.reason, PROSE_LIMIT) if reading.error else "no answer"
            text.append(f"  ✖ connection lost: {reason}", style=fmt.BAD)
            text.append(f"  ({seen}; retrying every {fmt.seconds(interval)})", style=fmt.WARN)
        if readonly:
            text.append("  read-only", style="reverse yellow")
        self.text = text
        self.refresh()

    def render(self) -> RenderableType:
        return self.text
