"""The fleet screen against real agent processes: two agents that answer and one that cannot.

The session agent and one more (prefix cache off, so its row differs), started once for the
module; the third URL has nothing listening, so it must be a row marked down, not an error.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agent_process import SMALL_POOL, RunningAgent, launch_agent

from kvctl.tui.app import TopApp
from kvctl.tui.detail import DetailScreen
from kvctl.tui.fleet_screen import FleetScreen
from kvctl.tui.source import HttpSource
from kvctl.tui.widgets.agent_bar import AgentBar

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

DEAD = "http://127.0.0.1:9"
SIZE = (120, 30)


@pytest.fixture(scope="module")
def quiet_agent() -> Iterator[RunningAgent]:
    """A second agent, with the prefix cache off."""
    running = launch_agent(*SMALL_POOL, "--no-prefix-cache")
    yield running
    running.stop()


def cells_of(app: TopApp) -> dict[str, list[str]]:
    """Each shown row's words, by agent."""
    table = app.fleet.query_one("#fleet")
    return {
        str(row.key.value): [str(cell).strip() for cell in table.get_row(row.key)]
        for row in table.ordered_rows
    }


def order(app: TopApp) -> list[str]:
    return [reading.agent for reading in app.fleet.shown]


@pytest.mark.slow  # a second agent starts (about 2 s) and stops (about 2 s)
async def test_the_fleet_of_real_agents(agent, quiet_agent, fakes) -> None:
    urls = [agent.url, quiet_agent.url, DEAD]
    app = TopApp(HttpSource(urls, timeout=10), interval=0.5)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.wait_until(pilot, lambda: len(app.fleet.shown) == 3)
        assert isinstance(app.screen, FleetScreen)
        rows = cells_of(app)
        short = [url.removeprefix("http://") for url in urls]
        assert [rows[url][0] for url in urls] == short
        assert rows[agent.url][1] == "up" and rows[quiet_agent.url][1] == "up"
        assert rows[quiet_agent.url][5] == "off"  # its prefix cache
        error = app.readings[DEAD].error
        assert rows[DEAD][1] == "down" and error is not None
        assert rows[DEAD][-1] == error.reason and "connection" in error.reason

        await pilot.press("s")  # by agent, A to Z
        assert order(app) == sorted(urls)
        await pilot.press("S")
        assert order(app) == sorted(urls, reverse=True)
        await pilot.press("s")  # by state: the down agent first
        assert order(app)[0] == DEAD

        port = quiet_agent.url.rsplit(":", 1)[1]
        await pilot.press("slash", *port, "enter")
        assert order(app) == [quiet_agent.url]
        await pilot.press("enter")  # opens the one row left
        assert isinstance(app.screen, DetailScreen)
        bar = fakes.widget_text(app.query_one(AgentBar), width=SIZE[0])
        assert f"agent 2/3  {quiet_agent.url}" in bar and "pool" in bar
        await pilot.press("escape")
        assert isinstance(app.screen, FleetScreen) and order(app) == [quiet_agent.url]
