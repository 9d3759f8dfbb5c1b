"""The `kvctl top` application: polls a `DataSource`, shows the fleet table and one agent's
detail, acts on keys.

The app owns the readings, the histories and the actions; the screens (`fleet_screen.py`,
`detail.py`, `screens.py`) only show them and offer keys, so both views always agree. On an
agent that serves several models it also owns which pool is shown (`p` moves on): the detail,
the sparklines (one history per agent and pool) and the actions are that pool's.

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
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.worker import Worker

from kvctl.api import DefragResult, ResizeRequest, ResizeResult
from kvctl.client import AgentError
from kvctl.fleet import Reading
from kvctl.sizing import ResizePlan
from kvctl.tui.detail import DetailScreen
from kvctl.tui.fleet_rows import row_key
from kvctl.tui.fleet_screen import FleetScreen
from kvctl.tui.history import WINDOWS, History, RateWindow
from kvctl.tui.screens import AlertsScreen, ConfirmScreen, HelpScreen, ResizeScreen
from kvctl.tui.source import DataSource
from kvctl.view.untrusted import PROSE_LIMIT, clean


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
        self.hold = 2.5 * interval  # a poll a little late is not a gap in the sparklines
        self.histories: dict[tuple[str, str | None], History] = {}
        """By agent and pool: every pool's numbers are kept, shown or not."""
        self.rates: dict[tuple[str, str | None], RateWindow] = {}
        self.pools: dict[str, str] = {}
        """The pool shown of each agent that serves several models (absent: its first)."""
        self.message = ""
        self.detail = DetailScreen(id="detail")
        self.fleet = FleetScreen()
        self._poll_worker: Worker[None] | None = None

    def get_default_screen(self) -> Screen[None]:
        return self.detail

    def on_mount(self) -> None:
        self.install_screen(self.fleet, "fleet")
        if len(self.source.agents) > 1 or self.source.fleet_first:
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
        on_fleet = not self.screen_stack or self.screen is self.fleet
        focus = None if on_fleet or not self.source.agents else self.agent
        readings = await self.source.read(dict(self.pools), focus)
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
        if reading.up:
            self.last_good[reading.agent] = (now, reading)
            for pool in reading.every_pool:
                self.history(reading.agent, pool.pool).add(pool, now)
                self.rate(reading.agent, pool.pool).add(pool)
            if previous is not None and not previous.up:
                self.say(f"{reading.agent} answers again")
        elif previous is None or previous.up:
            self.say(str(reading.error), severity="error")

    def history(self, agent: str, pool: str | None) -> History:
        """The sparklines' history of one pool of `agent` (None: before it ever answered)."""
        return self.histories.setdefault((agent, pool), History(self.hold))

    def rate(self, agent: str, pool: str | None) -> RateWindow:
        return self.rates.setdefault((agent, pool), RateWindow())

    def latest(self, agent: str) -> Reading | None:
        """The agent's latest reading that answered, else its latest one."""
        reading = self.readings.get(agent)
        if reading is not None and reading.up:
            return reading
        seen = self.last_good.get(agent)
        return seen[1] if seen is not None else reading

    def shown_pool(self, agent: str) -> str | None:
        """The name of the pool shown of `agent`; None while it has one (or never answered)."""
        reading = self.latest(agent)
        if reading is None or not reading.several:
            return None
        pool = reading.for_pool(self.pools.get(agent)).pool
        return None if pool is None else pool.pool

    def shown_key(self) -> str:
        """The fleet table's key of the agent and pool on the detail screen."""
        return row_key(self.agent, self.shown_pool(self.agent))

    def show_current(self) -> None:
        """Fill the detail screen from the shown agent's latest (or last good) reading, as its
        shown pool reads."""
        if not self.source.agents:  # a Prometheus that knows no node yet
            return
        agent = self.agent
        whole = self.readings.get(agent)
        if whole is None:
            return
        now = self.clock()
        seen, good = self.last_good.get(agent, (None, None))
        age = None if seen is None else now - seen
        name = self.shown_pool(agent)
        reading = whole.for_pool(name)
        good = None if good is None else good.for_pool(name)
        pool = reading.pool or (good.pool if good else None)
        key = None if pool is None else pool.pool
        latest = self.latest(agent)
        position = (self.current, len(self.source.agents))
        pools = None
        if latest is not None and latest.several and pool is not None:
            names = [p.pool for p in latest.pools]
            pools = (names.index(pool.pool), len(names)) if pool.pool in names else None
        self.detail.bar.show(position, reading, age, self.interval, self.readonly, pools)
        self.detail.show_budget(latest, name)
        self.detail.refresh_bindings()  # the acting keys follow whether this agent answers
        self.detail.show(
            reading, good, self.history(agent, key), self.window, now, self.rate(agent, key).rates()
        )
        if isinstance(self.screen, AlertsScreen):
            shown = reading if reading.up else good
            self.screen.show(agent, shown.alerts if shown else ())

    def say(self, message: str, severity: SeverityLevel = "information") -> None:
        """Tell the operator what happened: a toast and the message line under the panels,
        with the agent's words escaped (`untrusted.clean`), never read as markup."""
        message = clean(message, PROSE_LIMIT)
        self.message = message
        self.detail.say(message)
        self.notify(message, severity=severity, markup=False)

    # ---- navigation -----------------------------------------------------------------------

    def select(self, index: int) -> None:
        """Show the agent at `index` (wrapping around) on the detail screen."""
        self.current = index % len(self.source.agents)
        self.show_current()

    def open_agent(self, agent: str, pool: str | None = None) -> None:
        """From the fleet table into `agent`'s detail (showing `pool`, one of several)."""
        if pool is not None:
            self.pools[agent] = pool
        self.select(list(self.source.agents).index(agent))
        if self.screen is self.fleet:
            self.pop_screen()
        if pool is not None:
            self.poll()  # the map of that pool

    def next_pool(self, step: int) -> None:
        """Show the agent's next pool (`step` -1: the previous), where it serves several."""
        agent = self.agent
        reading = self.latest(agent)
        shown = self.shown_pool(agent)
        if reading is None or shown is None:
            return
        names = [pool.pool for pool in reading.pools]
        self.pools[agent] = names[(names.index(shown) + step) % len(names)]
        self.show_current()
        self.poll()  # the map of the pool now shown

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
        agent, pool = self.agent, self.shown_pool(self.agent)

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._defrag(agent, pool), group="act")

        which = "the pool" if pool is None else f"pool {pool}"
        self.push_screen(ConfirmScreen(f"Defragment {which} of {agent} now?"), answered)

    def ask_resize(self) -> None:
        agent, name = self.agent, self.shown_pool(self.agent)
        seen = self.last_good.get(agent)
        pool = None if seen is None else seen[1].for_pool(name).pool
        if pool is None:
            self.say(f"{agent} has not answered yet; cannot size a resize", "warning")
            return

        def chosen(plan: ResizePlan | None) -> None:
            if plan is not None:
                self.run_worker(self._resize(agent, plan.request, name), group="act")

        self.push_screen(ResizeScreen(agent, pool, named=name is not None), chosen)

    async def _defrag(self, agent: str, pool: str | None = None) -> None:
        try:
            result = await self.source.defrag(agent, pool)
        except AgentError as error:
            self.say(str(error), "error")
            return
        self.say(defrag_message(result, pool))
        self.poll()

    async def _resize(self, agent: str, request: ResizeRequest, pool: str | None = None) -> None:
        try:
            result = await self.source.resize(agent, request, pool)
        except AgentError as error:
            self.say(str(error), "error")
            return
        self.say(resize_message(result, pool))
        self.poll()


def defrag_message(result: DefragResult, pool: str | None = None) -> str:
    which = "" if pool is None else f" of {pool}"
    return (
        f"defrag{which}: fragmentation {result.fragmentation_before:.2f} → "
        f"{result.fragmentation_after:.2f}, {result.pages_moved:,} pages moved "
        f"in {result.seconds * 1000:.0f} ms"
    )


def resize_message(result: ResizeResult, pool: str | None = None) -> str:
    """What a resize did; for a pool of a shared budget, that it is now pinned and how to
    hand it back."""
    which = "" if pool is None else f" of {pool}"
    text = f"resize{which} ({result.direction}): {result.old_pages:,} → {result.new_pages:,} pages"
    if result.pinned:
        release = "kvctl pool release" + ("" if pool is None else f" --pool {pool}")
        text += f"; pinned until `{release}`"
    return text
