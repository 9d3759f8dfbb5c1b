"""The fleet screen with fake agents: rows, sorting, the filter, into an agent and back."""

from __future__ import annotations

import pytest

from kvctl.tui.detail import DetailScreen
from kvctl.tui.fleet_screen import FleetScreen, FleetTable
from kvctl.tui.widgets.agent_bar import AgentBar

pytestmark = pytest.mark.anyio

A, B, C = (f"http://node{i}:8477" for i in range(1, 4))
SIZE = (100, 30)


@pytest.fixture
def fleet(fakes) -> dict:
    """node1 fragmented with an alert, node2 down, node3 compact and quiet."""
    return {
        A: [fakes.reading(A)],
        B: [fakes.down(B)],
        C: [fakes.reading(C, largest_free_run=23, alerts=())],
    }


def rows(app) -> list[str]:
    """The agents of the fleet table, top to bottom."""
    return [reading.agent for reading in app.fleet.shown]


def table_lines(fakes, app) -> list[str]:
    return fakes.screen_text(app).splitlines()


async def test_several_agents_open_on_the_fleet_with_down_ones_as_rows(fakes, fleet) -> None:
    app = fakes.make_app(fleet)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        assert isinstance(app.screen, FleetScreen)
        lines = table_lines(fakes, app)
    assert lines[0].strip() == "fleet of 3 agents  2 up  1 down  1 alert firing"
    assert lines[2].split() == [
        *("node1:8477", "up", "98.50", "%", "0.78", "91.0", "%", "42.0", "%", "7", "2"),
        "KvctlFragmentationHigh",
    ]
    assert lines[3].split() == ["node2:8477", "down", *["–"] * 6, "connection", "refused"]
    assert lines[4].split()[-1] == "none"
    assert lines[-2].strip() == "in the order given"


async def test_readings_that_arrive_while_the_table_is_gone_wait_for_it(fakes, fleet) -> None:
    """A poll answered between the screen's mount and its table's (or while it is torn down)
    crashed `kvctl top` with NoMatches from the poll worker: the readings are kept and shown
    once the table is there."""
    app = fakes.make_app(fleet)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        table = app.fleet.query_one(FleetTable)
        await table.remove()
        app.fleet.show(app.fleet.readings)  # raised NoMatches
        await app.fleet.mount(FleetTable(cursor_type="row", cell_padding=0, id="fleet"))
        app.fleet.show(app.fleet.readings)
        await pilot.pause()
        assert rows(app) == [A, B, C]


async def test_s_cycles_the_sort_column_and_shift_s_reverses(fakes, fleet) -> None:
    app = fakes.make_app(fleet)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("s")
        assert rows(app) == [A, B, C]
        assert table_lines(fakes, app)[-2].strip() == "sorted by agent, A to Z"
        await pilot.press("S")
        assert rows(app) == [C, B, A]
        await pilot.press("s")  # state: down first
        assert rows(app)[0] == B
        await pilot.press("s", "S")  # alloc ok, reversed (all equal: the order given)
        await pilot.press("s")  # frag: worst first, the down agent last
        assert rows(app) == [A, C, B]
        assert "▼frag" in table_lines(fakes, app)[1]


async def test_clicking_a_header_sorts_by_it(fakes, fleet) -> None:
    app = fakes.make_app(fleet)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        column = table_lines(fakes, app)[1].index("frag")
        await pilot.click(FleetTable, offset=(column, 0))
        await pilot.pause()
        assert app.fleet.sort.key == "frag" and rows(app) == [A, C, B]
        await pilot.click(FleetTable, offset=(column, 0))
        await pilot.pause()
        assert rows(app) == [C, A, B]


async def test_the_filter_matches_names_and_alerts(fakes, fleet) -> None:
    app = fakes.make_app(fleet)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        assert "escape" not in app.screen.active_bindings  # nothing to clear yet
        await pilot.press("slash", *"node2")
        assert rows(app) == [B] and "escape" in app.screen.active_bindings
        await pilot.press("enter")  # keeps the filter, back to the table
        assert rows(app) == [B] and app.screen.focused is app.screen.query_one(FleetTable)
        status = table_lines(fakes, app)[-2].strip()
        assert status == "in the order given · filter “node2”: 1 of 3 agents (esc clears)"
        await pilot.press("escape")
        assert rows(app) == [A, B, C] and "escape" not in app.screen.active_bindings
        await pilot.press("slash", *"fragm")
        assert rows(app) == [A]


async def test_enter_opens_the_highlighted_agent_and_escape_comes_back(fakes, fleet) -> None:
    app = fakes.make_app(fleet)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("s", "S")  # agent, Z to A: node3, node2, node1
        table = app.screen.query_one(FleetTable)
        assert rows(app)[table.cursor_row] == A  # the cursor stayed on its agent
        await pilot.press("up", "enter")
        assert isinstance(app.screen, DetailScreen)
        assert f"agent 2/3  {B}" in fakes.widget_text(app.query_one(AgentBar))
        await pilot.press("tab")  # to node3
        await pilot.press("escape")
        assert isinstance(app.screen, FleetScreen)
        assert rows(app)[table.cursor_row] == C  # the agent last shown
        assert app.fleet.sort.key == "agent"  # the sort survives the trip


async def test_rows_follow_the_polls_and_the_cursor_its_agent(fakes) -> None:
    fleet = {
        A: [fakes.reading(A, requests_waiting=1), fakes.reading(A, requests_waiting=9)],
        B: [fakes.reading(B, requests_waiting=5)],
    }
    app = fakes.make_app(fleet)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        # no preempt column 100 cells wide
        for _ in range("agent state alloc frag util prefix run wait".count(" ") + 1):
            await pilot.press("s")
        assert app.fleet.sort.key == "wait" and rows(app) == [B, A]
        await pilot.press("down")  # on node1
        await fakes.polled(app, pilot, 2)
        table = app.screen.query_one(FleetTable)
        assert rows(app) == [A, B] and table.cursor_row == 0  # node1 moved up, and the cursor


async def test_one_agent_goes_straight_to_its_detail(fakes) -> None:
    app = fakes.make_app({A: [fakes.reading(A)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        assert isinstance(app.screen, DetailScreen)
