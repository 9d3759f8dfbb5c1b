"""The dashboard's dialogs and views: confirm, resize, help, alerts."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Label, Static

from kvctl.api import Alert, PoolSnapshot
from kvctl.sizing import ResizePlan, plan_from_text
from kvctl.units import format_bytes
from kvctl.view import render

DIALOG_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{
    width: 72; height: auto; padding: 1 2; border: thick $accent; background: $surface;
}}
{name} Horizontal {{ height: auto; align-horizontal: right; margin-top: 1; }}
{name} Button {{ margin-left: 2; }}
"""


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; `y` or Enter on the button says yes, `n` or Escape says no."""

    DEFAULT_CSS = DIALOG_CSS.format(name="ConfirmScreen")
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "yes"),
        Binding("n,escape", "answer(False)", "no"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, id="question")
            with Horizontal():
                yield Button("No", id="no")
                yield Button("Yes", id="yes", variant="warning")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class ResizeScreen(ModalScreen[ResizePlan | None]):
    """Type the new size (768, 8GiB, +1GiB, -64); the line below says what it will do."""

    DEFAULT_CSS = DIALOG_CSS.format(name="ResizeScreen") + "#plan { margin-top: 1; }"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "cancel")]

    def __init__(self, agent: str, pool: PoolSnapshot) -> None:
        super().__init__()
        self.agent = agent
        self.pool = pool
        self.plan: ResizePlan | None = None

    def compose(self) -> ComposeResult:
        pool = self.pool
        with Vertical():
            yield Label(
                f"Resize the pool of {self.agent}\nnow {pool.capacity_pages:,} pages "
                f"({format_bytes(pool.capacity_bytes)}), {pool.used_pages:,} used, "
                f"segments of {pool.segment_pages} pages"
            )
            yield Input(placeholder="768 pages, 8GiB, +1GiB or -64", id="size")
            yield Static("", id="plan")
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button("Resize", id="resize", variant="warning", disabled=True)

    def on_input_changed(self, event: Input.Changed) -> None:
        plan_line = self.query_one("#plan", Static)
        try:
            self.plan = plan_from_text(self.pool, event.value)
        except ValueError as error:
            self.plan = None
            plan_line.update(Text(str(error), style="yellow"))
        else:
            plan_line.update(render.resize_plan("new size", self.plan))
        self.query_one("#resize", Button).disabled = self.plan is None

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if self.plan is not None:
            self.dismiss(self.plan)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(self.plan if event.button.id == "resize" else None)

    def action_cancel(self) -> None:
        self.dismiss(None)


HELP = """\
[b]kvctl top[/b]: the KV-cache pool of one agent or a fleet, refreshed every --interval.

[b]d[/b]    defragment the shown pool now (asks first)
[b]r[/b]    resize the shown pool: pages, a size, +X to grow, -X to shrink
[b]a[/b]    alerts of the shown agent, with what to do about each
[b]tab[/b]  next agent of the fleet (shift+tab: previous)
[b]?[/b]    this help
[b]q[/b]    quit

The four numbers: allocation success (should stay 100 %), fragmentation of free pages \
(0 is contiguous), utilisation (used + cached pages of capacity), prefix hits (prompt tokens \
found in the cache). Red means the matching alert fires at the agent's default threshold.

Pool map: one glyph per slice of pages, its height how full the slice is; magenta used, \
cyan cached, grey free; ╵ marks where a segment (the unit of resize) begins.

With --readonly, d and r are not offered; while the shown agent does not answer, they are
shown dimmed and do nothing.
"""


class HelpScreen(ModalScreen[None]):
    """Keys and how to read the screen."""

    DEFAULT_CSS = DIALOG_CSS.format(name="HelpScreen").replace("width: 72", "width: 100")
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark,q", "close", "close")]

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(HELP)

    def action_close(self) -> None:
        self.dismiss(None)


class AlertsScreen(Screen[None]):
    """All alerts of the shown agent as a table, refreshed with each poll."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,a", "close", "back")]

    def __init__(self, agent: str, alerts: tuple[Alert, ...], clock: Callable[[], float]) -> None:
        super().__init__()
        self.agent = agent
        self.alerts = alerts
        self.clock = clock

    def compose(self) -> ComposeResult:
        yield Static(id="alerts-title")
        yield Static(id="alerts-table")
        yield Footer()

    def on_mount(self) -> None:
        self.show(self.agent, self.alerts)

    def show(self, agent: str, alerts: tuple[Alert, ...]) -> None:
        self.agent, self.alerts = agent, alerts
        self.query_one("#alerts-title", Static).update(Text(f"alerts of {agent}", style="bold"))
        table = render.alerts_table(alerts, now=self.clock())
        self.query_one("#alerts-table", Static).update(table)

    def action_close(self) -> None:
        self.dismiss(None)
