"""`kvctl top` fed hostile names: every screen shows them escaped, none is read as markup.

The agent URLs, pool and device names, alert words, tier policies, engine models and error
reasons all come from the nodes. A name such as `[/]` used to end the dashboard with a
MarkupError, `[bold red]owned[/]` was styled, and an ESC or C1 byte reached the terminal; here
each screen (detail, fleet, alerts, an engine's figures, the budget bar, the dialogs, the
message line) is drawn from each such name and must show it escaped (`kvctl.view.untrusted`).
"""

from __future__ import annotations

import re

import pytest
from pool_readings import tier_reading

from kvctl.client import AgentServerError
from kvctl.exposition import ModelFigures
from kvctl.figures import Figures
from kvctl.fleet import Reading
from kvctl.tui.fleet_screen import FleetScreen
from kvctl.tui.screens import AlertsScreen, ConfirmScreen, ResizeScreen
from kvctl.tui.widgets.budget_bar import BudgetBar

pytestmark = pytest.mark.anyio

SIZE = (160, 40)
CONTROLS = "\x1b]52;c;ZXZpbA==\x07\x1b[2J\x1b]0;title\x07\x9b31m\u202e"
NAMES = {
    "[/]": "[/]",
    "[bold red]owned[/]": "[bold red]owned[/]",
    CONTROLS: "\\x1b]52;c;ZXZpbA==",
    "m" * 5000: "m" * 12,
}
"""Names a node may give, each with a part of it the screen must show as it reads."""
RAW = ("\x1b", "\x9b", "\x07", "\u202e")


def assert_inert(text: str, name: str) -> None:
    for raw in RAW:
        assert raw not in text, f"{raw!r} reached the screen"
    assert re.search(r"(?<!\])owned", text) is None, "markup was applied"
    assert NAMES[name] in text, f"{NAMES[name]!r} is not on the screen:\n{text}"
    assert "m" * 300 not in text, "a long name was not cut"


def hostile_reading(fakes, name: str) -> Reading:
    """An agent whose URL, pool, device, alerts and tier policy are `name`."""
    alert = fakes.alert(name, severity="critical").model_copy(
        update={"summary": name, "description": name, "remediation": name, "runbook_url": name}
    )
    pending = fakes.alert(name, state="pending")
    tiers = [tier_reading("host", policy=name), tier_reading("disk", policy=name, path=name)]
    return fakes.reading(name, alerts=(alert, pending), pool=name, device=name, tiers=tiers)


async def open_screen(fakes, app, pilot, key: str, screen: type) -> str:
    """The screen's text once `key` has opened a `screen`."""
    await pilot.press(key)
    await fakes.wait_until(pilot, lambda: isinstance(app.screen, screen))
    await pilot.pause()
    return fakes.screen_text(app)


async def test_the_detail_alerts_and_dialogs_show_an_agents_names_escaped(fakes) -> None:
    for name in NAMES:
        app = fakes.make_app({name: [hostile_reading(fakes, name)]})
        async with app.run_test(size=SIZE) as pilot:
            await fakes.polled(app, pilot)
            assert_inert(fakes.screen_text(app), name)
            assert_inert(await open_screen(fakes, app, pilot, "a", AlertsScreen), name)
            await pilot.press("escape")
            assert_inert(await open_screen(fakes, app, pilot, "d", ConfirmScreen), name)
            await pilot.press("n")
            assert_inert(await open_screen(fakes, app, pilot, "r", ResizeScreen), name)


async def test_the_fleet_shows_names_alerts_and_reasons_escaped(fakes) -> None:
    for name in NAMES:
        down = Reading(agent=f"down{name}", error=AgentServerError(name, name, name))
        other = f"b{name}"
        readings = {
            name: [hostile_reading(fakes, name)],
            other: [fakes.pools_reading(other)],
            down.agent: [down],
        }
        app = fakes.make_app(readings)
        async with app.run_test(size=SIZE) as pilot:
            await fakes.polled(app, pilot)
            assert isinstance(app.screen, FleetScreen)
            assert_inert(fakes.screen_text(app), name)
            await pilot.press("slash", *"[/]")
            await pilot.pause()
            text = fakes.screen_text(app)
            assert "filter “[/]”" in text and not any(raw in text for raw in RAW)


async def test_an_engine_node_shows_its_models_and_notes_escaped(fakes) -> None:
    figures = Figures(utilization_ratio=0.5, requests_running=1, requests_waiting=0)
    for name in NAMES:
        engine = Reading(
            agent=f"http://v:8000/{name}",
            engine="vllm",
            figures=figures,
            models=(ModelFigures(name, figures), ModelFigures(f"second {name}", figures)),
            model=name,
            source="metrics",
            notes=(f"note {name}",),
        )
        app = fakes.make_app({engine.agent: [engine]})
        async with app.run_test(size=SIZE) as pilot:
            await fakes.polled(app, pilot)
            assert_inert(fakes.screen_text(app), name)


async def test_the_budget_bar_names_each_pool_escaped(fakes) -> None:
    for name in NAMES:
        reading = fakes.pools_reading(name)
        chat, code = reading.pools
        pools = (chat.model_copy(update={"pool": name}), code.model_copy(update={"pool": "[/]"}))
        reading = Reading(
            agent=name, health=reading.health, pool=pools[0], pools=pools,
            alerts=reading.alerts, budget_bytes=reading.budget_bytes,
        )  # fmt: skip
        app = fakes.make_app({name: [reading]})
        async with app.run_test(size=SIZE) as pilot:
            await fakes.polled(app, pilot)
            bar = fakes.widget_text(app.query_one(BudgetBar), width=SIZE[0])
            assert_inert(fakes.screen_text(app), name)
        assert not any(raw in bar for raw in RAW)
        assert "[/]" in bar or len(name) > 1000  # a long name leaves the other no room


async def test_the_message_line_and_the_toast_show_an_error_escaped(fakes) -> None:
    agent = "http://node1:8477"
    said = f"agent said [/] {CONTROLS}"
    down = Reading(agent=agent, error=AgentServerError(agent, said, said))
    app = fakes.make_app({agent: [fakes.reading(agent), down]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot, 2)
        await pilot.pause()
        text = fakes.screen_text(app)
    assert "agent said [/] \\x1b]52;c;ZXZpbA==" in text
    assert not any(raw in text for raw in RAW)
