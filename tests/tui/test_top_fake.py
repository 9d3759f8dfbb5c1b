"""One agent's detail screen with fake agents: what each panel shows, the keys, connection loss.

Data comes from a FakeSource (fixed readings, one per poll) and a clock of one second a poll,
so the screen is the same on every run.
"""

from __future__ import annotations

import pytest

from kvctl.api import ResizeRequest
from kvctl.tui.detail import DetailScreen
from kvctl.tui.screens import AlertsScreen, ConfirmScreen, HelpScreen, ResizeScreen
from kvctl.tui.widgets.agent_bar import AgentBar
from kvctl.tui.widgets.alerts import AlertsPanel
from kvctl.tui.widgets.headlines import Headlines
from kvctl.tui.widgets.pool_map import PoolMapView
from kvctl.tui.widgets.requests import RequestsPanel

pytestmark = pytest.mark.anyio  # anyio's pytest plugin runs the async tests (on asyncio)

NODE1, NODE2 = "http://node1:8477", "http://node2:8477"
SIZE = (100, 34)


def history(fakes) -> list:
    """Five readings, one a second: utilisation rising (67 % to 99 %), fragmentation falling
    (0.90 to 0.00)."""
    readings = []
    for i in range(5):
        used = 90 + 20 * i
        free = 256 - 83 - used
        largest = round(free * (0.1 + 0.2 * i))
        readings.append(
            fakes.reading(NODE1, used_pages=used, free_pages=free, largest_free_run=largest)
        )
    return readings


async def test_panels_show_the_reading(fakes) -> None:
    app = fakes.make_app({NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        headlines = fakes.widget_text(app.query_one(Headlines))
        pool_map = fakes.widget_text(app.query_one(PoolMapView), width=98)
        requests = fakes.widget_text(app.query_one(RequestsPanel))
        alerts = fakes.widget_text(app.query_one(AlertsPanel))
        bar = fakes.widget_text(app.query_one(AgentBar))
    assert "98.50 %" in headlines and "0.78" in headlines and "91.0 %" in headlines
    assert "42.0 %" in headlines
    assert "█ used 150   ▓ cached 83   · free 23" in pool_map
    assert "running 7   waiting 2   preemptions 5" in requests
    assert "gpu0 H200: 100 GiB of 140 GiB 71.4 %" in requests
    assert "● critical KvctlFragmentationHigh" in alerts
    assert "→ kvctl defrag --now" in alerts and "1 pending" in alerts
    assert "agent 1/1" in bar and NODE1 in bar and "up 1h02m" in bar


def spark_row(fakes, app) -> list[str]:
    """The sparklines of the four numbers, as drawn (the third line of the panel)."""
    row = fakes.widget_text(app.query_one(Headlines)).splitlines()[2]
    column = app.query_one(Headlines).size.width // 4
    return [row[i * column : (i + 1) * column - 3] for i in range(4)]


async def test_w_switches_the_time_span_of_the_sparklines(fakes) -> None:
    app = fakes.make_app({NODE1: history(fakes)})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot, 5)  # one reading a second, from t=1 to t=5
        panel = app.query_one("#headlines").parent
        assert panel.border_title == "the four numbers · last 1m"
        _, frag, util, _ = spark_row(fakes, app)
        # 5 s of a minute: the last of 21 bars (2.9 s each) hold the readings, the rest is empty
        assert util.strip() and util.startswith(" " * 18)
        await pilot.press("w")
        assert panel.border_title == "the four numbers · last 10m"
        await pilot.press("w")
        assert panel.border_title == "the four numbers · last 1h"
        await pilot.press("w")
        assert panel.border_title == "the four numbers · whole session (4.0 s)"
        _, frag, util, _ = spark_row(fakes, app)
        # the session fills the width: utilisation rising, fragmentation falling, bar by bar
        assert " " not in util and list(util) == sorted(util) and util[0] != util[-1]
        assert " " not in frag and list(frag) == sorted(frag, reverse=True)
        await pilot.press("w")
        assert panel.border_title == "the four numbers · last 1m"


async def test_connection_loss_is_shown_and_recovers(fakes) -> None:
    series = [fakes.reading(NODE1), fakes.down(NODE1), fakes.reading(NODE1, used_pages=10)]
    app = fakes.make_app({NODE1: series})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot, 2)
        bar = fakes.widget_text(app.query_one(AgentBar))
        assert "✖ connection lost: connection refused" in bar
        assert "last answer" in bar and "retrying every" in bar
        assert "98.50 %" in fakes.widget_text(app.query_one(Headlines))  # last good, dimmed
        await fakes.polled(app, pilot, 3)
        assert "connection lost" not in fakes.widget_text(app.query_one(AgentBar))
        assert app.message == f"{NODE1} answers again"


async def test_an_agent_that_never_answered(fakes) -> None:
    app = fakes.make_app({NODE1: [fakes.down(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        assert "never answered" in fakes.widget_text(app.query_one(AgentBar))
        assert "no reading yet" in fakes.widget_text(app.query_one(Headlines))
        await pilot.press("d", "r")
        await pilot.pause()
        assert len(app.screen_stack) == 1  # nothing to act on
        bindings = app.screen.active_bindings
        assert not bindings["d"].enabled and not bindings["r"].enabled  # shown, disabled


async def test_tab_goes_through_the_fleet(fakes) -> None:
    app = fakes.make_app({NODE1: [fakes.reading(NODE1)], NODE2: [fakes.down(NODE2)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("enter")  # the fleet table first; the first agent is highlighted
        assert isinstance(app.screen, DetailScreen)
        await pilot.press("tab")
        bar = fakes.widget_text(app.query_one(AgentBar))
        assert "agent 2/2" in bar and NODE2 in bar and "connection lost" in bar
        await pilot.press("tab")
        assert "agent 1/2" in fakes.widget_text(app.query_one(AgentBar))
        await pilot.press("shift+tab")
        assert "agent 2/2" in fakes.widget_text(app.query_one(AgentBar))


async def test_one_agent_has_no_fleet_keys(fakes) -> None:
    app = fakes.make_app({NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        assert isinstance(app.screen, DetailScreen)
        bindings = app.screen.active_bindings
        assert "escape" not in bindings and "tab" not in bindings
        await pilot.press("escape", "f")
        assert isinstance(app.screen, DetailScreen)


async def test_defrag_asks_first(fakes) -> None:
    app = fakes.make_app({NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert app.source.defrags == []
        await pilot.press("d", "y")
        await fakes.wait_until(pilot, lambda: app.source.defrags == [NODE1])
        await fakes.wait_until(pilot, lambda: app.message.startswith("defrag:"))
        assert app.message == "defrag: fragmentation 0.62 → 0.05, 48 pages moved in 12 ms"


async def test_resize_dialog(fakes) -> None:
    app = fakes.make_app({NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("r")
        dialog = app.screen
        assert isinstance(dialog, ResizeScreen)
        await pilot.press(*"lots")
        assert "cannot read" in fakes.widget_text(dialog.query_one("#plan"))
        await pilot.press("enter")
        assert app.screen is dialog  # nothing to submit yet
        await pilot.press(*("backspace",) * 4, *"+32")
        assert "256 pages (16 MiB) → 288 pages (18 MiB)" in fakes.widget_text(
            dialog.query_one("#plan")
        )
        await pilot.press("enter")
        await fakes.wait_until(pilot, lambda: app.source.resizes != [])
        assert app.source.resizes == [(NODE1, ResizeRequest(pages=288))]
        await fakes.wait_until(pilot, lambda: app.message.startswith("resize"))
        assert app.message == "resize (grow): 256 → 288 pages"


async def test_resize_dialog_escape_changes_nothing(fakes) -> None:
    app = fakes.make_app({NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("r", *"-64", "escape")
        await pilot.pause()
        assert not isinstance(app.screen, ResizeScreen)
        assert app.source.resizes == []


async def test_readonly_disables_the_acting_keys(fakes) -> None:
    app = fakes.make_app({NODE1: [fakes.reading(NODE1)]}, readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("d", "r")
        await pilot.pause()
        assert len(app.screen_stack) == 1
        assert (app.source.defrags, app.source.resizes) == ([], [])
        assert "read-only" in fakes.widget_text(app.query_one(AgentBar))
        assert "d" not in app.screen.active_bindings and "r" not in app.screen.active_bindings
        assert app.screen.active_bindings["q"].enabled


async def test_help_and_alerts_views(fakes) -> None:
    app = fakes.make_app({NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape", "a")
        assert isinstance(app.screen, AlertsScreen)
        table = fakes.screen_text(app)
        assert "KvctlFragmentationHigh" in table and "kvctl defrag --now" in table
        assert "firing for 2m01s" in table  # since NOW - 120, read at NOW + 1 (one poll)
        await pilot.press("a")
        assert not isinstance(app.screen, AlertsScreen)


async def test_quit(fakes) -> None:
    app = fakes.make_app({NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running
    assert app.source.closed


async def test_a_poll_answered_after_the_app_closed_changes_nothing(fakes) -> None:
    app = fakes.make_app({NODE1: [fakes.reading(NODE1)]})
    async with app.run_test() as pilot:
        await fakes.polled(app, pilot)
    assert not app.screen_stack
    await app._poll()  # the agents' answer arriving during shutdown must not raise
