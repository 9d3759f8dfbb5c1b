"""The `kvctl top` application: polls a `DataSource`, shows one agent at a time, acts on keys.

Polling is a timer that starts a worker coroutine; a poll still waiting on a slow agent is
not started again, and Textual's timer schedules against its start, so the period does not
drift. A failed reading keeps the last good numbers on screen (dimmed) and says why in the top
bar; the next good reading clears it, so a restart of the agent needs no action here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import Footer, Static
from textual.worker import Worker

from kvctl.api import DefragResult, ResizeRequest, ResizeResult
from kvctl.client import AgentError
from kvctl.fleet import Reading
from kvctl.sizing import ResizePlan
from kvctl.tui.history import History
from kvctl.tui.screens import AlertsScreen, ConfirmScreen, HelpScreen, ResizeScreen
from kvctl.tui.source import DataSource
from kvctl.tui.widgets.agent_bar import AgentBar
from kvctl.tui.widgets.alerts import AlertsPanel
from kvctl.tui.widgets.headlines import Headlines
from kvctl.tui.widgets.pool_map import PoolMapView
from kvctl.tui.widgets.requests import RequestsPanel

ACTING = ("defrag", "resize")


class TopApp(App[None]):
    """Live dashboard of the agents of `source`, one shown at a time."""

    TITLE = "kvctl top"
    CSS = """
    Screen { layout: vertical; }
    .panel {
        height: auto; border: round $primary-lighten-2; border-title-color: $text; padding: 0 1;
    }
    #panels { height: auto; }
    #panels > Vertical { width: 1fr; height: auto; }
    #message { height: 1; color: $text-muted; padding: 0 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("d", "defrag", "defrag"),
        Binding("r", "resize", "resize"),
        Binding("a", "alerts", "alerts"),
        Binding("tab", "next_agent(1)", "next agent", priority=True),
        Binding("shift+tab", "next_agent(-1)", "previous", show=False, priority=True),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(
        self,
        source: DataSource,
        interval: float = 1.0,
        readonly: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.source = source
        self.interval = interval
        self.readonly = readonly
        self.clock = clock
        self.current = 0
        self.readings: dict[str, Reading] = {}
        self.last_good: dict[str, tuple[float, Reading]] = {}
        self.histories: dict[str, History] = {agent: History() for agent in source.agents}
        self.message = ""
        self._poll_worker: Worker[None] | None = None

    # ---- layout ---------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield AgentBar(id="agent")
        yield self._panel(Headlines(id="headlines"), "the four numbers")
        with Horizontal(id="panels"):
            yield self._panel(RequestsPanel(id="requests"), "requests and memory")
            yield self._panel(AlertsPanel(id="alerts"), "firing alerts")
        map_panel = self._panel(PoolMapView(id="map"), "pool map")
        map_panel.styles.height = "1fr"
        yield map_panel
        yield Static("", id="message")
        yield Footer()

    @staticmethod
    def _panel(widget: Widget, title: str) -> Vertical:
        box = Vertical(widget, classes="panel")
        box.border_title = title
        return box

    def on_mount(self) -> None:
        self.poll()
        self.set_interval(self.interval, self.poll)

    async def on_unmount(self) -> None:
        await self.source.close()

    # ---- polling --------------------------------------------------------------------------

    @property
    def agent(self) -> str:
        return self.source.agents[self.current]

    def poll(self) -> None:
        """Start a poll unless one is still waiting for an answer."""
        if self._poll_worker is None or self._poll_worker.is_finished:
            self._poll_worker = self.run_worker(self._poll(), group="poll")

    async def _poll(self) -> None:
        readings = await self.source.read()
        now = self.clock()
        for reading in readings:
            self._remember(reading, now)
        self.show_current()

    def _remember(self, reading: Reading, now: float) -> None:
        previous = self.readings.get(reading.agent)
        self.readings[reading.agent] = reading
        if reading.up and reading.pool is not None:
            self.last_good[reading.agent] = (now, reading)
            self.histories[reading.agent].add(reading.pool)
            if previous is not None and not previous.up:
                self.say(f"{reading.agent} answers again")
        elif previous is None or previous.up:
            self.say(str(reading.error), severity="error")

    def show_current(self) -> None:
        """Fill every panel from the shown agent's latest (or last good) reading."""
        agent = self.agent
        reading = self.readings.get(agent)
        if reading is None:
            return
        seen, good = self.last_good.get(agent, (None, None))
        age = None if seen is None else self.clock() - seen
        position = (self.current, len(self.source.agents))
        self.query_one(AgentBar).show(position, reading, age, self.interval, self.readonly)
        self.refresh_bindings()  # the acting keys follow whether this agent answers
        shown = reading if reading.up else good
        pool = shown.pool if shown else None
        self.query_one(Headlines).show(pool, self.histories[agent], stale=not reading.up)
        self.query_one(PoolMapView).show(shown.map if shown else None)
        self.query_one(RequestsPanel).show(pool)
        self.query_one(AlertsPanel).show(shown.alerts if shown else ())
        if isinstance(self.screen, AlertsScreen):
            self.screen.show(agent, shown.alerts if shown else ())

    def say(self, message: str, severity: str = "information") -> None:
        """Tell the operator what happened: a toast and the message line under the panels."""
        self.message = message
        self.query_one("#message", Static).update(message)
        self.notify(message, severity=severity)  # type: ignore[arg-type]

    # ---- keys -----------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Acting keys are not offered at all with --readonly, and shown disabled while the
        agent on screen does not answer (they could not reach it)."""
        if action in ACTING:
            if self.readonly:
                return False
            reading = self.readings.get(self.agent)
            if reading is None or not reading.up:
                return None
        return True

    def action_next_agent(self, step: int) -> None:
        self.current = (self.current + step) % len(self.source.agents)
        self.show_current()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_alerts(self) -> None:
        reading = self.readings.get(self.agent)
        self.push_screen(AlertsScreen(self.agent, reading.alerts if reading else (), self.clock))

    def action_defrag(self) -> None:
        agent = self.agent

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._defrag(agent), group="act")

        self.push_screen(ConfirmScreen(f"Defragment the pool of {agent} now?"), answered)

    def action_resize(self) -> None:
        agent = self.agent
        seen = self.last_good.get(agent)
        if seen is None or seen[1].pool is None:
            self.say(f"{agent} has not answered yet; cannot size a resize", "warning")
            return

        def chosen(plan: ResizePlan | None) -> None:
            if plan is not None:
                self.run_worker(self._resize(agent, plan.request), group="act")

        self.push_screen(ResizeScreen(agent, seen[1].pool), chosen)

    async def _defrag(self, agent: str) -> None:
        try:
            result = await self.source.defrag(agent)
        except AgentError as error:
            self.say(str(error), "error")
            return
        self.say(defrag_message(result))
        self.poll()

    async def _resize(self, agent: str, request: ResizeRequest) -> None:
        try:
            result = await self.source.resize(agent, request)
        except AgentError as error:
            self.say(str(error), "error")
            return
        self.say(resize_message(result))
        self.poll()


def defrag_message(result: DefragResult) -> str:
    return (
        f"defrag: fragmentation {result.fragmentation_before:.2f} → "
        f"{result.fragmentation_after:.2f}, {result.pages_moved:,} pages moved "
        f"in {result.seconds * 1000:.0f} ms"
    )


def resize_message(result: ResizeResult) -> str:
    return f"resize ({result.direction}): {result.old_pages:,} → {result.new_pages:,} pages"
