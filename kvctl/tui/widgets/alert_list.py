"""Every alert of one agent in full: a block per alert rather than a table, because six
columns squeezed into 80 terminal columns fold names and commands mid-word."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvctl.api import Alert
from kvctl.tui.widgets.alerts import heading, worst_first
from kvctl.view import fmt
from kvctl.view.untrusted import PROSE_LIMIT, clean


def alert_block(alert: Alert, now: float) -> list[RenderableType]:
    """Heading with state and age on the right, then summary, description, fix, runbook."""
    top = Table.grid(expand=True, padding=(0, 0, 0, 2))
    top.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
    top.add_column(no_wrap=True, justify="right")
    age = fmt.seconds(max(0.0, now - alert.active_since))
    state_style = "bold" if alert.state == "firing" else "dim"
    top.add_row(heading(alert), Text(f"{alert.state} for {age}", style=state_style))
    lines: list[RenderableType] = [top, Text(f"  {clean(alert.summary, PROSE_LIMIT)}")]
    if alert.description:
        lines.append(Text(f"  {clean(alert.description, PROSE_LIMIT)}", style="dim"))
    lines.append(Text(f"  → {clean(alert.remediation, PROSE_LIMIT)}", style="bold"))
    lines.append(Text(f"  runbook {clean(alert.runbook_url, PROSE_LIMIT)}", style="dim"))
    return lines


def alert_blocks(alerts: Sequence[Alert], now: float) -> RenderableType:
    """All alerts, firing first and worst first, a blank line between them."""
    if not alerts:
        return Text("no alerts", style=fmt.OK)
    lines: list[RenderableType] = []
    for index, alert in enumerate(worst_first(alerts)):
        if index:
            lines.append(Text(""))
        lines.extend(alert_block(alert, now))
    return Group(*lines)
