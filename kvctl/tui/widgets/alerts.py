"""Firing alerts, worst first, each with the command or setting that fixes it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text
from textual.widget import Widget

from kvctl.api import Alert
from kvctl.view import fmt
from kvctl.view.untrusted import PROSE_LIMIT, clean

ORDER = {"critical": 0, "warning": 1, "info": 2}


def worst_first(alerts: Sequence[Alert]) -> list[Alert]:
    """Firing before pending, then by severity, then by name."""
    return sorted(alerts, key=lambda a: (a.state != "firing", ORDER[a.severity], a.name))


SUMMARY_MIN = 12
"""Fewer columns than this left after the name: the summary is left out, not cut to a stub."""


def heading(alert: Alert, width: int | None = None) -> Text:
    """`● severity Name  summary` on one line, never wrapped: the summary only with `width`
    and only where a useful part of it fits (cut with an ellipsis); a panel narrower than the
    name cuts the name with an ellipsis rather than breaking it."""
    text = Text.assemble(
        (f"● {alert.severity} ", fmt.severity_style(alert.severity)),
        (clean(alert.name), "bold"),
        no_wrap=True,
        overflow="ellipsis",
    )
    summary = f"  {clean(alert.summary, PROSE_LIMIT)}"
    if width is not None and len(text) + min(len(summary), SUMMARY_MIN) <= width:
        text.append(summary)
    return text


class AlertsPanel(Widget):
    """The firing alerts of the shown agent; pending ones are counted, not listed."""

    DEFAULT_CSS = """
    AlertsPanel { height: auto; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.alerts: tuple[Alert, ...] = ()

    def show(self, alerts: Sequence[Alert]) -> None:
        self.alerts = tuple(alerts)
        self.refresh(layout=True)

    def render(self) -> RenderableType:
        firing = [alert for alert in worst_first(self.alerts) if alert.state == "firing"]
        pending = len(self.alerts) - len(firing)
        if not firing:
            note = f" ({pending} pending)" if pending else ""
            return Text(f"no alerts firing{note}", style=fmt.OK)
        lines: list[Text] = []
        for alert in firing:
            lines.append(heading(alert, self.size.width))
            lines.append(Text(f"  → {clean(alert.remediation, PROSE_LIMIT)}", style="bold"))
        if pending:
            lines.append(Text(f"{pending} pending (a: all alerts)", style="dim"))
        return Group(*lines)
