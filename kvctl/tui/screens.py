"""The dashboard's dialogs and views: confirm, resize, help, alerts."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Label, Static

from kvctl.api import Alert, PoolSnapshot
from kvctl.sizing import ResizePlan, plan_from_text
from kvctl.tui.widgets.alert_list import alert_blocks
from kvctl.units import format_bytes
from kvctl.view import render
from kvctl.view.untrusted import PROSE_LIMIT, clean, safe

DIALOG_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{
    width: 72; height: auto; padding: 1 2; border: thick $accent; background: $surface;
}}
{name} Horizontal {{ height: auto; align-horizontal: right; margin-top: 1; }}
{name} Button {{ margin-left: 2; }}
"""


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; `y` or Enter on the button says yes, `n` or Escape says no. The
    question names agents and pools, so it is shown cleaned (`untrusted.clean`)."""

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
            yield Label(safe(self.question, limit=PROSE_LIMIT), id="question")
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

    def __init__(self, agent: str, pool: PoolSnapshot, named: bool = False) -> None:
        """`named`: the pool is one of several on its agent, so the dialog names it."""
        super().__init__()
        self.agent = agent
        self.pool = pool
        self.named = named
        self.plan: ResizePlan | None = None

    def compose(self) -> ComposeResult:
        pool = self.pool
        which = f"pool {clean(pool.pool)}" if self.named else "the pool"
        pins = ""
        if pool.share is not None and not pool.share.pinned:
            pins = "\nthe new size is pinned: the agent stops moving memory in or out of it"
        with Vertical():
            yield Label(
                Text(
                    f"Resize {which} of {clean(self.agent)}\nnow {pool.capacity_pages:,} pages "
                    f"({format_bytes(pool.capacity_bytes)}), {pool.used_pages:,} used, "
                    f"segments of {pool.segment_pages} pages{pins}"
                )
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
            plan_line.update(Text(render.resize_plan("new size", self.plan)))
        self.query_one("#resize", Button).disabled = self.plan is None

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if self.plan is not None:
            self.dismiss(self.plan)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(self.plan if event.button.id == "resize" else None)

    def action_cancel(self) -> None:
        self.dismiss(None)


HELP_INTRO = (
    "[b]kvctl top[/b]: the KV-cache pool of one agent or a fleet, refreshed every --interval. "
    "With several agents it opens on the fleet table; with one, on that agent."
)
HELP_KEYS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "Fleet table",
        (
            ("enter", "open the highlighted agent (or click it twice)"),
            ("s", "sort by the next column, worst first (or click a header)"),
            ("S", "reverse the sort"),
            ("/", "filter by part of an agent URL, a pool or an alert name; esc clears it"),
        ),
    ),
    (
        "One agent",
        (
            ("esc, f", "back to the fleet table"),
            ("tab", "next agent of the fleet (shift+tab: previous)"),
            ("p", "next pool of an agent that serves several models (P: previous)"),
            ("d", "defragment the shown pool now (asks first)"),
            ("r", "resize the shown pool: pages, a size, +X to grow, -X to shrink"),
            ("a", "alerts of the shown agent, with what to do about each"),
            ("w", "time span of the sparklines: last 1m, 10m, 1h, whole session"),
        ),
    ),
    ("Anywhere", (("?", "this help (↑ ↓ to scroll)"), ("q", "quit"))),
)
HELP_NOTES = (
    "The four numbers: allocation success (should stay 100 %), fragmentation of free pages "
    "(0 is contiguous), utilisation (used + cached pages of capacity), prefix hits (prompt "
    "tokens found in the cache). Red means the matching alert fires at the agent's default "
    "threshold. Each sparkline bar is the worst reading in its slice of the span, so a short "
    "dip stays visible; older history is kept at a coarser grain, never dropped.",
    "Pool map: one glyph per slice of pages, its height how full the slice is; magenta used, "
    "cyan cached, grey free; ╵ marks where a segment (the unit of resize) begins.",
    "Tiers (beside the map, only for an agent started with --host-tier-memory or "
    "--disk-tier-path): the share of reused prompt tokens found on the device, in host memory "
    "and on disk over the last 10 s, the prompt tokens a second the cache saved computing, and "
    "per tier how full it is and the bytes a second loaded from it; a load should cost less "
    "per token than prefill. kvctl pool resize --tier host|disk changes a tier's size.",
    "Budget bar (several models on one agent): their memory budget split by pool, the shown "
    "pool bright, then what is free; a pool resized with r stays pinned (the agent moves no "
    "memory in or out) until kvctl pool release.",
    "With --readonly, d and r are not offered; while the shown agent does not answer, they are "
    "shown dimmed and do nothing. A down agent stays in the fleet table, with why.",
)


def help_text() -> Group:
    """The help: keys in a column of their own, so a wrapped description stays indented."""
    parts: list[RenderableType] = [Text.from_markup(HELP_INTRO)]
    for title, keys in HELP_KEYS:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True, min_width=6)
        grid.add_column()
        for key, what in keys:
            grid.add_row(key, what)
        parts += [Text(""), Text(title, style="bold underline"), grid]
    for note in HELP_NOTES:
        parts += [Text(""), Text(note)]
    return Group(*parts)


class HelpScreen(ModalScreen[None]):
    """Keys and how to read the screen; scrolls where the terminal is too small for it."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 100; max-width: 100%; height: auto; max-height: 100%;
        padding: 0 1; border: thick $accent; background: $surface;
        scrollbar-size-vertical: 1;
    }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark,q", "close", "close")]

    def compose(self) -> ComposeResult:
        box = VerticalScroll()
        box.border_subtitle = "esc close"
        with box:
            yield Static(help_text())

    def action_close(self) -> None:
        self.dismiss(None)


class AlertsScreen(Screen[None]):
    """All alerts of the shown agent in full, refreshed with each poll."""

    DEFAULT_CSS = """
    AlertsScreen #alerts-title { height: 1; background: $boost; }
    AlertsScreen VerticalScroll { height: 1fr; padding: 0 1; scrollbar-size-vertical: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,a", "close", "back")]

    def __init__(self, agent: str, alerts: tuple[Alert, ...], clock: Callable[[], float]) -> None:
        super().__init__()
        self.agent = agent
        self.alerts = alerts
        self.clock = clock

    def compose(self) -> ComposeResult:
        yield Static(id="alerts-title")
        with VerticalScroll():
            yield Static(id="alerts-list")
        yield Footer()

    def on_mount(self) -> None:
        self.show(self.agent, self.alerts)

    def show(self, agent: str, alerts: tuple[Alert, ...]) -> None:
        self.agent, self.alerts = agent, alerts
        firing = sum(1 for alert in alerts if alert.state == "firing")
        title = Text.assemble(
            (f" alerts of {clean(agent)} ", "reverse"),
            f"  {firing} firing, {len(alerts) - firing} pending",
        )
        self.query_one("#alerts-title", Static).update(title)
        self.query_one("#alerts-list", Static).update(alert_blocks(alerts, now=self.clock()))

    def action_close(self) -> None:
        self.dismiss(None)
