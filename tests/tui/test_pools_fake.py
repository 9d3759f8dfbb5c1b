"""The pool switcher with a fake agent serving two models: what `p` changes, what the agent is
asked for, and which pool the actions go to."""

from __future__ import annotations

import pytest

from kvctl.tui.screens import ConfirmScreen, ResizeScreen
from kvctl.tui.widgets.agent_bar import AgentBar

pytestmark = pytest.mark.anyio

A = "http://node1:8477"
SIZE = (100, 30)


def bar(fakes, app) -> str:
    return fakes.widget_text(app.query_one(AgentBar), width=SIZE[0])


async def test_p_shows_the_next_pool_and_polls_for_it(fakes) -> None:
    app = fakes.make_app({A: [fakes.pools_reading(A)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        assert app.source.pools_asked[0] == {}  # the first poll: the agent's first pool
        assert "pool chat (1/2, p next)" in bar(fakes, app)
        await pilot.press("p")
        assert "pool code (2/2, p next)" in bar(fakes, app)
        assert "pool code on cpu: 192 pages (24 MiB)" in fakes.widget_text(app.detail.requests)
        await fakes.polled(app, pilot, app.source.polls + 1)
        assert app.source.pools_asked[-1] == {A: "code"}
        await pilot.press("p")  # round again
        assert "pool chat (1/2" in bar(fakes, app)
    assert {key for key in app.histories} == {(A, "chat"), (A, "code")}  # both kept all along


async def test_actions_go_to_the_shown_pool(fakes) -> None:
    app = fakes.make_app({A: [fakes.pools_reading(A)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("p", "d")
        assert isinstance(app.screen, ConfirmScreen)
        assert app.screen.question == f"Defragment pool code of {A} now?"
        await pilot.press("y")
        await fakes.wait_until(pilot, lambda: app.message.startswith("defrag of code:"))
        await pilot.press("r")
        assert isinstance(app.screen, ResizeScreen)
        label = str(app.screen.query_one("Label").render())
        assert label.startswith(f"Resize pool code of {A}")
        await pilot.press(*"288", "enter")
        await fakes.wait_until(pilot, lambda: app.message.startswith("resize"))
    assert app.source.acted_on == ["code", "code"]
    assert app.message == (
        "resize of code (grow): 256 → 288 pages; pinned until `kvctl pool release --pool code`"
    )


async def test_one_pool_has_no_pool_key_and_no_budget_bar(fakes) -> None:
    app = fakes.make_app({A: [fakes.reading(A)]})
    async with app.run_test(size=SIZE) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("p")
        assert app.detail.check_action("next_pool", (1,)) is False
        assert not app.detail.budget.display
        assert "(1/" not in bar(fakes, app)
        assert app.source.pools_asked == [{}]
