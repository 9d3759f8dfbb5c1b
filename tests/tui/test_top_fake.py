"""The dashboard with fake agents: what each panel shows, the keys, connection loss.

Data comes from a FakeSource (fixed readings, one per poll) and a fixed clock, so the screen is
the same on every run; `test_main_screen_snapshot` compares it with a stored text snapshot
(set KVCTL_UPDATE_SNAPSHOTS=1 to rewrite it after a deliberate change, then review the diff).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvctl.api import ResizeRequest
from kvctl.tui.app import TopApp
from kvctl.tui.screens import AlertsScreen, ConfirmScreen, HelpScreen, ResizeScreen
from kvctl.tui.widgets.agent_bar import AgentBar
from kvctl.tui.widgets.alerts import AlertsPanel
from kvctl.tui.widgets.headlines import Headlines
from kvctl.tui.widgets.pool_map import PoolMapView
from kvctl.tui.widgets.requests import RequestsPanel

pytestmark = pytest.mark.anyio  # anyio's pytest plugin runs the async tests (on asyncio)

SNAPSHOT = Path(__file__).parent / "snapshots" / "main_screen.txt"
NODE1, NODE2 = "http://node1:8477", "http://node2:8477"
SIZE = (100, 34)


def app_for(fakes, readings: dict, readonly: bool = False) -> TopApp:
    """An app polling only when told (a long interval), with a fixed clock."""
    source = fakes.FakeSource(readings)
    return TopApp(source, interval=3600, readonly=readonly, clock=lambda: 1_800_000_000.0)


async def polled(app: TopApp, pilot, count: int = 1) -> None:
    """Wait until `count` polls (the first one at start included) have finished."""
    while app.source.polls < count or not app._poll_worker.is_finished:
        app.poll()  # starts one only when none is running
        await pilot.pause(0.01)


def history(fakes) -> list:
    """Five readings with rising utilisation and falling fragmentation."""
    return [
        fakes.reading(NODE1, utilization_ratio=0.5 + 0.1 * i, fragmentation_ratio=0.9 - 0.07 * i)
        for i in range(5)
    ]


async def test_main_screen_snapshot(fakes) -> None:
    app = app_for(fakes, {NODE1: history(fakes)})
    async with app.run_test(size=SIZE) as pilot:
        await polled(app, pilot, 5)
        await pilot.pause()
        lines = fakes.screen_text(app).splitlines()[:-1]  # the footer is Textual's, not ours
    text = "\n".join(line.rstrip() for line in lines) + "\n"
    if os.environ.get("KVCTL_UPDATE_SNAPSHOTS"):
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text()


async def test_panels_show_the_reading(fakes) -> None:
    app = app_for(fakes, {NODE1: history(fakes)})
    async with app.run_test(size=SIZE) as pilot:
        await polled(app, pilot, 6)
        headlines = fakes.widget_text(app.query_one(Headlines))
        pool_map = fakes.widget_text(app.query_one(PoolMapView), width=98)
        requests = fakes.widget_text(app.query_one(RequestsPanel))
        alerts = fakes.widget_text(app.query_one(AlertsPanel))
        bar = fakes.widget_text(app.query_one(AgentBar))
    assert "98.50 %" in headlines and "0.62" in headlines and "90.0 %" in headlines
    assert "42.0 %" in headlines
    # six polls of five readings (the last repeats): utilisation rising, fragmentation falling
    assert "▅▅▆▇▇▇" in headlines and "▇▇▆▆▅▅" in headlines
    assert "■ used 150   ■ cached 83   ■ free 23" in pool_map
    assert "running 7   waiting 2   preemptions 5" in requests
    assert "gpu0 H200: 100 GiB of 140 GiB 71.4 %" in requests
    assert "● critical KvctlFragmentationHigh" in alerts
    assert "→ kvctl defrag --now" in alerts and "1 pending" in alerts
    assert "agent 1/1" in bar and NODE1 in bar and "up 1h02m" in bar


async def test_connection_loss_is_shown_and_recovers(fakes) -> None:
    series = [fakes.reading(NODE1), fakes.down(NODE1), fakes.reading(NODE1, used_pages=10)]
    app = app_for(fakes, {NODE1: series})
    async with app.run_test(size=SIZE) as pilot:
        await polled(app, pilot, 2)
        bar = fakes.widget_text(app.query_one(AgentBar))
        assert "✖ connection lost: connection refused" in bar
        assert "last answer" in bar and "retrying every" in bar
        assert "98.50 %" in fakes.widget_text(app.query_one(Headlines))  # last good, dimmed
        await polled(app, pilot, 3)
        assert "connection lost" not in fakes.widget_text(app.query_one(AgentBar))
        assert app.message == f"{NODE1} answers again"


async def test_an_agent_that_never_answered(fakes) -> None:
    app = app_for(fakes, {NODE1: [fakes.down(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await polled(app, pilot)
        assert "never answered" in fakes.widget_text(app.query_one(AgentBar))
        assert "no reading yet" in fakes.widget_text(app.query_one(Headlines))
        await pilot.press("d", "r")
        await pilot.pause()
        assert len(app.screen_stack) == 1  # nothing to act on
        bindings = app.screen.active_bindings
        assert not bindings["d"].enabled and not bindings["r"].enabled  # shown, disabled


async def test_tab_goes_through_the_fleet(fakes) -> None:
    app = app_for(fakes, {NODE1: [fakes.reading(NODE1)], NODE2: [fakes.down(NODE2)]})
    async with app.run_test(size=SIZE) as pilot:
        await polled(app, pilot)
        await pilot.press("tab")
        bar = fakes.widget_text(app.query_one(AgentBar))
        assert "agent 2/2" in bar and NODE2 in bar and "connection lost" in bar
        await pilot.press("tab")
        assert "agent 1/2" in fakes.widget_text(app.query_one(AgentBar))
        await pilot.press("shift+tab")
        assert "agent 2/2" in fakes.widget_text(app.query_one(AgentBar))


async def test_defrag_asks_first(fakes) -> None:
    app = app_for(fakes, {NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await polled(app, pilot)
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert app.source.defrags == []
        await pilot.press("d", "y")
        await fakes.wait_until(pilot, lambda: app.source.defrags == [NODE1])
        await fakes.wait_until(pilot, lambda: app.message.startswith("defrag:"))
        assert app.message == "defrag: fragmentation 0.62 → 0.05, 48 pages moved in 12 ms"


async def test_resize_dialog(fakes) -> None:
    app = app_for(fakes, {NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await polled(app, pilot)
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
    app = app_for(fakes, {NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await polled(app, pilot)
        await pilot.press("r", *"-64", "escape")
        await pilot.pause()
        assert not isinstance(app.screen, ResizeScreen)
        assert app.source.resizes == []


async def test_readonly_disables_the_acting_keys(fakes) -> None:
    app = app_for(fakes, {NODE1: [fakes.reading(NODE1)]}, readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        await polled(app, pilot)
        await pilot.press("d", "r")
        await pilot.pause()
        assert len(app.screen_stack) == 1
        assert (app.source.defrags, app.source.resizes) == ([], [])
        assert "read-only" in fakes.widget_text(app.query_one(AgentBar))
        assert "d" not in app.screen.active_bindings and "r" not in app.screen.active_bindings
        assert app.screen.active_bindings["q"].enabled


async def test_help_and_alerts_views(fakes) -> None:
    app = app_for(fakes, {NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await polled(app, pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape", "a")
        assert isinstance(app.screen, AlertsScreen)
        table = fakes.screen_text(app)
        assert "KvctlFragmentationHigh" in table and "kvctl defrag --now" in table
        assert "2m00s" in table  # active for 120 s by the fixed clock
        await pilot.press("a")
        assert not isinstance(app.screen, AlertsScreen)


async def test_quit(fakes) -> None:
    app = app_for(fakes, {NODE1: [fakes.reading(NODE1)]})
    async with app.run_test(size=SIZE) as pilot:
        await polled(app, pilot)
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running
    assert app.source.closed
