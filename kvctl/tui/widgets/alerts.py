"""Firing alerts, worst first, each with the command or setting that fixes it."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.text import Text
from textual.widget import Widget

from kvctl.api import Alert
from kvctl.view import fmt

ORDER = {"critical": 0, "warning": 1, "info": 2}


class AlertsPanel(Widget):
    """The firing alerts of the shown agent; pending ones are counted, not listed."""

    DEFAULT_CSS = """
    AlertsPanel { height: auto; }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.alerts: tuple[Alert, ...] = ()

    def show(self, alerts: Sequence[Alert]) -> None:
        self.alerts = tuple(alerts)
        self.refresh(layout=True)

    def render(self) -> RenderableType:
        firing = sorted(
            (a for a in self.alerts if a.state == "firing"), key=lambda a: ORDER[a.severity]
        )
        pending = len(self.alerts) - len(firing)
        if not firing:
            note = f" ({pending} pending)" if pending else ""
            return Text(f"no alerts firing{note}", style=fmt.OK)
        lines: list[Text] = []
        for alert in firing:
            lines.append(
                Text.assemble(
                    (f"● {alert.severity} ", fmt.severity_style(alert.severity)),
                    (alert.name, "bold"),
                    f"  {alert.summary}",
                )
            )
            lines.append(Text(f"  → {alert.remediation}", style="bold"))
        if pending:
            lines.append(Text(f"{pending} pending", style="dim"))
        return Group(*lines)
