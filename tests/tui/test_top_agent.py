"""`kvctl top` against a real agent: the keys act on the agent, and quitting stops polling.

The session agent is shared, so the resize test puts the size back.
"""

from __future__ import annotations

import pytest

from kvctl.api import ResizeRequest
from kvctl.client import AgentClient
from kvctl.tui.app import TopApp
from kvctl.tui.screens import ConfirmScreen, ResizeScreen
from kvctl.tui.source import HttpSource
from kvctl.tui.widgets.agent_bar import AgentBar
from kvctl.tui.widgets.headlines import Headlines

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

SIZE = (100, 34)


def dashboard(*urls: str) -> TopApp:
    return TopApp(HttpSource(list(urls), timeout=10), interval=0.5)


def manual_runs(url: str) -> int:
    with AgentClient(url) as client:
        return client.pool().defrag_runs_total.get("manual", 0)


async def test_live_numbers_and_defrag_key(agent, fakes) -> None:
    before = manual_runs(agent.url)
    app = dashboard(agent.url)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.wait_until(pilot, lambda: agent.url in app.last_good)
        assert "ALLOC SUCCESS" in fakes.widget_text(app.query_one(Headlines))
        assert f"agent 1/1  {agent.url}" in fakes.widget_text(app.query_one(AgentBar))
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await fakes.wait_until(pilot, lambda: app.message.startswith("defrag:"))
    assert manual_runs(agent.url) == before + 1


async def test_resize_dialog_resizes_the_agent(agent, fakes) -> None:
    with AgentClient(agent.url) as client:
        pool = client.pool()
    app = dashboard(agent.url)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await fakes.wait_until(pilot, lambda: agent.url in app.last_good)
            await pilot.press("r")
            assert isinstance(app.screen, ResizeScreen)
            await pilot.press(*f"+{pool.segment_pages}", "enter")
            await fakes.wait_until(pilot, lambda: app.message.startswith("resize"))
            assert app.message == (
                f"resize (grow): {pool.capacity_pages:,} → "
                f"{pool.capacity_pages + pool.segment_pages:,} pages"
            )
            with AgentClient(agent.url) as client:
                grown = client.pool().capacity_pages
            assert grown == pool.capacity_pages + pool.segment_pages
    finally:
        with AgentClient(agent.url) as client:
            client.resize(ResizeRequest(pages=pool.capacity_pages))


async def test_quit_stops_the_dashboard(agent, fakes) -> None:
    app = dashboard(agent.url)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.wait_until(pilot, lambda: agent.url in app.last_good)
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


async def test_an_unreachable_agent_is_shown_not_raised(fakes) -> None:
    app = dashboard("http://127.0.0.1:9")
    async with app.run_test(size=SIZE) as pilot:
        await fakes.wait_until(pilot, lambda: "http://127.0.0.1:9" in app.readings)
        bar = fakes.widget_text(app.query_one(AgentBar))
        assert "✖ connection lost:" in bar and "never answered" in bar
        assert app.message.startswith("cannot reach agent at http://127.0.0.1:9")
