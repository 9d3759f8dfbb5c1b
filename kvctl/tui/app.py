"""The `kvctl top` application: polls a `DataSource`, shows the fleet table and one agent's
detail, acts on keys.

The app owns the readings, the histories and the actions; the screens (`fleet_screen.py`,
`detail.py`, `screens.py`) only show them and offer keys, so both views always agree.

Polling is a timer that starts a worker coroutine; a poll still waiting on a slow agent is
not started again, and Textual's timer schedules against its start, so the period does not
drift. A failed reading keeps the last good numbers on screen (dimmed) and says why in the top
bar; the next good reading clears it, so a restart of the agent needs no action here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.worker import Worker

from kvctl.api import DefragResult, ResizeRequest, ResizeResult
from kvctl.client import AgentError
from kvctl.fleet import Reading
from kvctl.sizing import ResizePlan
from kvctl.tui.detail import DetailScreen
from kvctl.tui.fleet_screen import FleetScreen
from kvctl.tui.history import WINDOWS, History, RateWindow
from kvctl.tui.screens import AlertsScreen, ConfirmScreen, HelpScreen, ResizeScreen
from kvctl.tui.source import DataSource


class TopApp(App[None]):
    """Live dashboard of the agents of `source`: the fleet table first when there are several,
    an agent's detail straight away when there is one."""

    TITLE = "kvctl top"
    ENABLE_COMMAND_PALETTE = False  # nothing in it an operator needs; its key takes footer room
    CSS = """
    ToastRack { margin-bottom: 2; }  /* above the status line and the footer, never on them */
    """
    BINDINGS: ClassVar[list[BindingType]] = [
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
        self.window = WINDOWS[0]
        self.readings: dict[str, Reading] = {}
        self.last_good: dict[str, tuple[float, Reading]] = {}
        hold = 2.5 * interval  # a poll a little late is not a gap in the sparklines
        self.histories: dict[str, History] = {agent: History(hold) for agent in source.agents}
        self.rates: dict[str, RateWindow] = {agent: RateWindow() for agent in source.agents}
        self.message = ""
        self.detail = DetailScreen(id="detail")
        self.fleet = FleetScreen()
        self._poll_worker: Worker[None] | None = None

    def get_default_screen(self) -> Screen[None]:
        return self.detail

    def on_mount(self) -> None:
        self.install_screen(self.fleet, "fleet")
        if len(self.source.agents) > 1:
            self.push_screen("fleet")
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
        if not self.screen_stack:  # the app closed while the agents answered
            return
        now = self.clock()
        for reading in readings:
            self._remember(reading, now)
        self.show_current()
        self.fleet.show([self.readings[a] for a in self.source.agents if a in self.readings])

    def _remember(self, reading: Reading, now: float) -> None:
        previous = self.readings.get(reading.agent)
        self.readings[reading.agent] = reading
        if reading.up and reading.pool is not None:
            self.last_good[reading.agent] = (now, reading)
            self.histories[reading.agent].add(reading.pool, now)
            self.rates[reading.agent].add(reading.pool)
            if previous is not None and not previous.up:
                self.say(f"{reading.agent} answers again")
        elif previous is None or previous.up:
            self.say(str(reading.error), severity="error")

    def show_current(self) -> None:
        """Fill the detail screen from the shown agent's latest (or last good) reading."""
        agent = self.agent
        reading = self.readings.get(agent)
        if reading is None:
            return
        now = self.clock()
        seen, good = self.last_good.get(agent, (None, None))
        age = None if seen is None else now - seen
        position = (self.current, len(self.source.agents))
        self.detail.bar.show(position, reading, age, self.interval, self.readonly)
        self.detail.refresh_bindings()  # the acting keys follow whether this agent answers
        self.detail.show(
            reading, good, self.histories[agent], self.window, now, self.rates[agent].rates()
        )
        if isinstance(self.screen, AlertsScreen):
            shown = reading if reading.up else good
            self.screen.show(agent, shown.alerts if shown else ())

    def say(self, message: str, severity: str = "information") -> None:
        """Tell the operator what happened: a toast and the message line under the panels."""
        self.message = message
        self.detail.say(message)
        self.notify(message, severity=severity)  # type: ignore[arg-type]

    # ---- navigation -----------------------------------------------------------------------

    def select(self, index: int) -> None:
        """Show the agent at `index` (wrapping around) on the detail screen."""
        self.current = index % len(self.source.agents)
        self.show_current()

    def open_agent(self, agent: str) -> None:
        """From the fleet table into `agent`'s detail."""
        self.select(list(self.source.agents).index(agent))
        if self.screen is self.fleet:
            self.pop_screen()

    def show_fleet(self) -> None:
        if self.screen is not self.fleet:
            self.push_screen("fleet")

    def next_window(self) -> None:
        """The next time span of the sparklines: 1m, 10m, 1h, the whole session."""
        self.window = WINDOWS[(WINDOWS.index(self.window) + 1) % len(WINDOWS)]
        self.show_current()

    # ---- keys -----------------------------------------------------------------------------

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def show_alerts(self) -> None:
        reading = self.readings.get(self.agent)
        self.push_screen(AlertsScreen(self.agent, reading.alerts if reading else (), self.clock))

    def ask_defrag(self) -> None:
        agent = self.agent

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._defrag(agent), group="act")

        self.push_screen(ConfirmScreen(f"Defragment the pool of {agent} now?"), answered)

    def ask_resize(self) -> None:
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
