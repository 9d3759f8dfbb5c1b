"""One agent in detail: the four numbers with their history, requests, alerts, the page map,
and the tiers below the device when the agent has any.

A node whose agent API was not read (an engine read from its /metrics, a node known only from
Prometheus) has no page map or history of pools: one panel shows what its source exported,
"–" for the rest, and its engine's pitfalls; the acting keys are off.

An agent that serves several models shows one pool at a time (`p` the next, `P` the previous),
under a bar of the memory budget its pools share, split by pool.

The screen only lays the panels out and offers the keys that act on the agent shown; the app
owns the readings and does the acting, so the fleet screen and this one show the same data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rich.console import Group, RenderableType
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Static

from kvctl.fleet import Reading
from kvctl.tui.history import History, Window
from kvctl.tui.widgets.agent_bar import AgentBar
from kvctl.tui.widgets.alerts import AlertsPanel
from kvctl.tui.widgets.budget_bar import BudgetBar
from kvctl.tui.widgets.headlines import Headlines
from kvctl.tui.widgets.pool_map import PoolMapView
from kvctl.tui.widgets.requests import RequestsPanel
from kvctl.tui.widgets.tiers import TierPanel
from kvctl.view import engine, fmt, render
from kvctl.view.tiers import TierRates

if TYPE_CHECKING:
    from kvctl.tui.app import TopApp

ACTING = ("defrag", "resize")
HEADLINES_TITLE = "the four numbers"


class DetailScreen(Screen[None]):
    """The dashboard of the agent the app has selected."""

    DEFAULT_CSS = """
    DetailScreen { layout: vertical; }
    DetailScreen .panel {
        height: auto; border: round $primary-lighten-2; border-title-color: $text; padding: 0 1;
    }
    DetailScreen #panels { height: auto; }
    DetailScreen #panels > Vertical { width: 1fr; height: auto; }
    DetailScreen #bottom { height: 1fr; }
    DetailScreen #bottom > Vertical { width: 1fr; height: 1fr; }
    DetailScreen #message { height: 1; color: $text-muted; padding: 0 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,f", "fleet", "fleet", key_display="esc"),
        Binding("tab", "next_agent(1)", "next", priority=True),
        Binding("shift+tab", "next_agent(-1)", "previous", show=False, priority=True),
        # Not in the footer, which a fleet fills at 80 columns: the agent bar says "p next".
        Binding("p", "next_pool(1)", "pool", show=False),
        Binding("P", "next_pool(-1)", "previous pool", show=False),
        Binding("d", "defrag", "defrag"),
        Binding("r", "resize", "resize"),
        Binding("a", "alerts", "alerts"),
        Binding("w", "window", "window"),
    ]

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        # Held, not queried: the app fills them from its first poll, which may come before
        # the screen has mounted them.
        self.bar = AgentBar(id="agent")
        self.budget = BudgetBar(id="budget")
        self.budget.display = False  # until a reading says the agent's pools share a budget
        self.headlines = Headlines(id="headlines")
        self.requests = RequestsPanel(id="requests")
        self.alerts = AlertsPanel(id="alerts")
        self.pool_map = PoolMapView(id="map")
        self.tiers = TierPanel(id="tiers")
        self.message = Static("", id="message")
        self.headlines_panel = self._panel(self.headlines, HEADLINES_TITLE)
        self.tiers_panel = self._panel(self.tiers, "tiers below the device")
        self.tiers_panel.display = False  # until a reading says the agent has tiers
        self.figures = Static("", id="figures")
        self.figures_panel = self._panel(self.figures, "what this node exports")
        self.figures_panel.display = False  # until a reading without a pool is shown
        self.panels = Horizontal(id="panels")
        self.bottom = Horizontal(id="bottom")

    @property
    def top(self) -> TopApp:
        return self.app  # type: ignore[return-value]  # Textual types it App[object]; only TopApp mounts this

    def compose(self) -> ComposeResult:
        yield self.bar
        yield self.budget
        yield self.figures_panel
        yield self.headlines_panel
        with self.panels:
            yield self._panel(self.requests, "requests and memory")
            yield self._panel(self.alerts, "firing alerts")
        with self.bottom:  # the map, and the tiers beside it when there are any
            yield self._panel(self.pool_map, "pool map")
            yield self.tiers_panel
        yield self.message
        yield Footer()

    @staticmethod
    def _panel(widget: Widget, title: str) -> Vertical:
        box = Vertical(widget, classes="panel")
        box.border_title = title
        return box

    def show(
        self,
        reading: Reading,
        good: Reading | None,
        history: History,
        window: Window,
        now: float,
        rates: TierRates | None = None,
    ) -> None:
        """Fill every panel: `good` (the last reading that answered) while `reading` failed;
        `rates` are the agent's per-second rates for the tier panel."""
        shown = reading if reading.up else good
        pool = shown.pool if shown else None
        only_figures = shown is not None and pool is None and shown.figures is not None
        self.figures_panel.display = only_figures
        for box in (self.headlines_panel, self.panels, self.bottom):
            box.display = not only_figures
        if only_figures and shown is not None:
            self.figures.update(figures_view(shown, stale=not reading.up))
            return
        self.headlines.show(pool, history, stale=not reading.up, now=now, window=window)
        self.headlines_panel.border_title = (
            f"{HEADLINES_TITLE} · {window_label(window, history, now)}"
        )
        self.pool_map.show(shown.map if shown else None)
        self.requests.show(pool)
        self.alerts.show(shown.alerts if shown else ())
        self.tiers.show(pool, rates if reading.up else None, stale=not reading.up)
        self.tiers_panel.display = pool is not None and bool(pool.tiers)

    def show_budget(self, reading: Reading | None, shown: str | None) -> None:
        """The budget bar of `reading` (the whole agent) with pool `shown` on screen; only for
        an agent whose pools share a budget."""
        pools = () if reading is None else reading.every_pool
        self.budget.display = len(pools) > 1 or any(pool.share for pool in pools)
        self.budget.show(reading, shown)

    def say(self, message: str) -> None:
        """Show `message` (already cleaned by the app) as it reads, not as markup."""
        self.message.update(Text(message))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Acting keys are not offered at all with --readonly, and shown disabled while the
        agent on screen does not answer (they could not reach it); the fleet key only where
        there is a fleet, the pool key only where the agent serves several models."""
        if action in ACTING:
            if self.top.readonly:
                return False
            reading = self.top.readings.get(self.top.agent)
            if reading is None or not reading.up or not reading.acts:
                return None
        if action in ("fleet", "next_agent"):
            return len(self.top.source.agents) > 1
        if action == "next_pool":
            return self.top.shown_pool(self.top.agent) is not None
        return True

    def action_fleet(self) -> None:
        self.top.show_fleet()

    def action_next_agent(self, step: int) -> None:
        self.top.select(self.top.current + step)

    def action_next_pool(self, step: int) -> None:
        self.top.next_pool(step)

    def action_defrag(self) -> None:
        self.top.ask_defrag()

    def action_resize(self) -> None:
        self.top.ask_resize()

    def action_alerts(self) -> None:
        self.top.show_alerts()

    def action_window(self) -> None:
        self.top.next_window()


def figures_view(reading: Reading, stale: bool) -> RenderableType:
    """The figures a node's source exported, its alerts where they were read."""
    parts: list[RenderableType] = [engine.detail(reading)]
    if reading.alerts_read:
        parts.append(render.alerts_table(reading.alerts))
    if stale:
        parts.append(Text("no answer now: the last figures it gave", style=fmt.WARN))
    return Group(*parts)


def window_label(window: Window, history: History, now: float) -> str:
    """What the sparklines span: "last 10m", or the session and how long it has run."""
    if window.seconds is not None:
        return f"last {window.label}"
    start = history.start
    return "whole session" + ("" if start is None else f" ({fmt.seconds(now - start)})")
