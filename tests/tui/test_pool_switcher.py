"""`kvctl top` against a real agent serving two models: `p` switches the shown pool (numbers,
map, actions), the budget bar splits the budget by pool, and the fleet table has a row per
agent and pool.

One agent for the module: `small` (4 MiB of 64 KiB pages) and `big` (8 MiB of 128 KiB pages)
in a 12 MiB budget. Nothing here resizes, so the split stays 1 : 2 with nothing free.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agent_process import RunningAgent, launch_agent

from kvctl.client import AgentClient
from kvctl.tui.app import TopApp
from kvctl.tui.detail import DetailScreen
from kvctl.tui.fleet_screen import FleetScreen
from kvctl.tui.screens import ConfirmScreen
from kvctl.tui.source import HttpSource
from kvctl.tui.widgets.agent_bar import AgentBar
from kvctl.tui.widgets.budget_bar import BudgetBar
from kvctl.tui.widgets.requests import RequestsPanel

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

TWO_MODELS = ("--model", "small=demo", "--model", "big=demo:8x4")
TWO_POOLS = ("--pool-pages", "64", "--segment-pages", "16")
SIZE = (120, 34)


@pytest.fixture(scope="module")
def two_models() -> Iterator[RunningAgent]:
    running = launch_agent(*TWO_MODELS, *TWO_POOLS)
    yield running
    running.stop()


def dashboard(*urls: str) -> TopApp:
    return TopApp(HttpSource(list(urls), timeout=10), interval=0.5)


def mapped(app: TopApp) -> str | None:
    """The pool whose page map the detail shows."""
    page_map = app.detail.pool_map.page_map
    return None if page_map is None or page_map.pool is None else page_map.pool.pool


def manual_runs(url: str, pool: str) -> int:
    with AgentClient(url) as client:
        return client.pool(pool).defrag_runs_total.get("manual", 0)


async def test_p_switches_the_shown_pool(two_models, fakes) -> None:
    url = two_models.url
    app = dashboard(url)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.wait_until(pilot, lambda: mapped(app) == "small")
        bar = fakes.widget_text(app.query_one(AgentBar), width=SIZE[0])
        assert "pool small (1/2, p next) on cpu" in bar
        assert "pool small on cpu: 64 pages (4 MiB)" in fakes.widget_text(app.detail.requests)

        await pilot.press("p")
        await fakes.wait_until(pilot, lambda: mapped(app) == "big")
        bar = fakes.widget_text(app.query_one(AgentBar), width=SIZE[0])
        assert "pool big (2/2, p next) on cpu" in bar
        requests = fakes.widget_text(app.query_one(RequestsPanel), width=SIZE[0])
        assert "pool big on cpu: 64 pages (8 MiB)" in requests
        assert app.detail.pool_map.page_map.capacity_pages == 64

        await pilot.press("P")  # back, the other way round
        await fakes.wait_until(pilot, lambda: mapped(app) == "small")
        assert "pool small (1/2" in fakes.widget_text(app.query_one(AgentBar), width=SIZE[0])


async def test_the_budget_bar_shows_each_pools_share(two_models, fakes) -> None:
    app = dashboard(two_models.url)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.wait_until(pilot, lambda: two_models.url in app.last_good)
        assert app.detail.budget.display
        line = fakes.widget_text(app.query_one(BudgetBar), width=SIZE[0]).splitlines()[0]
    assert line.startswith(" budget 12 MiB ▕")
    assert "█ small 4 MiB" in line and "▓ big 8 MiB" in line and "░ 0 B free" in line
    bar = line[line.index("▕") + 1 : line.index("▏")]
    assert set(bar) == {"█", "▓"}  # the whole budget is assigned
    assert abs(bar.count("▓") - 2 * bar.count("█")) <= 1  # 8 MiB beside 4 MiB


async def test_d_defragments_the_shown_pool_only(two_models, fakes) -> None:
    url = two_models.url
    small, big = manual_runs(url, "small"), manual_runs(url, "big")
    app = dashboard(url)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.wait_until(pilot, lambda: mapped(app) == "small")
        await pilot.press("p")
        await fakes.wait_until(pilot, lambda: mapped(app) == "big")
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        assert app.screen.question == f"Defragment pool big of {url} now?"
        await pilot.press("y")
        await fakes.wait_until(pilot, lambda: app.message.startswith("defrag of big:"))
    assert (manual_runs(url, "small"), manual_runs(url, "big")) == (small, big + 1)


async def test_the_fleet_has_a_row_per_agent_and_pool(agent, two_models, fakes) -> None:
    app = dashboard(agent.url, two_models.url)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.wait_until(pilot, lambda: len(app.fleet.shown) == 3)
        assert isinstance(app.screen, FleetScreen)
        table = app.fleet.query_one("#fleet")
        rows = {
            str(row.key.value): [str(cell).strip() for cell in table.get_row(row.key)]
            for row in table.ordered_rows
        }
        url = two_models.url
        assert list(rows) == [agent.url, f"{url}#small", f"{url}#big"]
        assert [cells[1] for cells in rows.values()] == ["demo", "small", "big"]
        assert "fleet of 2 agents, 3 pools" in fakes.screen_text(app)

        await pilot.press("down", "down", "enter")  # the big pool's row
        assert isinstance(app.screen, DetailScreen)
        await fakes.wait_until(pilot, lambda: mapped(app) == "big")
        assert "pool big (2/2" in fakes.widget_text(app.query_one(AgentBar), width=SIZE[0])
        await pilot.press("escape")
        assert isinstance(app.screen, FleetScreen)
        assert table.cursor_row == 2  # back on the row it came from
