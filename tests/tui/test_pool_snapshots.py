"""Text snapshots of the detail of an agent serving two models, at 80×24 and 160×45: the agent
bar names the shown pool (1/2), the budget bar splits the budget by pool, and the panels are
the shown pool's. A minute of polls on a clock of five seconds a poll, as in test_snapshots.py.
Set KVCTL_UPDATE_SNAPSHOTS=1 to rewrite the files after a deliberate change, then review them.
"""

from __future__ import annotations

import pytest

from kvctl.tui.detail import DetailScreen
from kvctl.tui.widgets.budget_bar import BudgetBar

pytestmark = pytest.mark.anyio

A = "http://node1:8477"
POLLS = 13
STEP = 5.0


def scenario(fakes) -> dict:
    """`chat` filling up poll by poll beside the pinned `code` pool."""
    series = []
    for i in range(POLLS):
        used = 60 + 7 * i
        series.append(fakes.pools_reading(A, used_pages=used, free_pages=173 - used))
    return {A: series}


@pytest.mark.parametrize("size", [(80, 24), (160, 45)], ids=["80x24", "160x45"])
async def test_snapshot_of_the_detail_of_two_pools(fakes, size: tuple[int, int]) -> None:
    app = fakes.make_app(scenario(fakes), step=STEP)
    async with app.run_test(size=size) as pilot:
        await fakes.polled(app, pilot, POLLS)
        assert isinstance(app.screen, DetailScreen)
        text = fakes.screen_text(app)
    assert len(text.splitlines()) == size[1]
    lines = text.splitlines()
    assert "pool chat (1/2, p next)" in lines[0]
    assert lines[1].startswith(" budget 48 MiB ▕")
    fakes.check_snapshot(f"pools_{size[0]}x{size[1]}", text)


@pytest.mark.parametrize("width", [80, 120, 160])
async def test_the_budget_bar_gives_each_pool_its_share(fakes, width: int) -> None:
    """16 and 24 MiB of a 48 MiB budget: a third, a half and a sixth free, to a cell."""
    app = fakes.make_app({A: [fakes.pools_reading(A)]})
    async with app.run_test(size=(width, 30)) as pilot:
        await fakes.polled(app, pilot)
        line = fakes.widget_text(app.query_one(BudgetBar), width=width).splitlines()[0]
    bar = line[line.index("▕") + 1 : line.index("▏")]
    assert set(bar) == {"█", "▓", "░"} and bar == "".join(sorted(bar, key="█▓░".index))
    cells = len(bar)
    assert abs(bar.count("█") - cells / 3) <= 1
    assert abs(bar.count("▓") - cells / 2) <= 1
    assert abs(bar.count("░") - cells / 6) <= 1
    assert cells >= width // 4
    assert "█ chat" in line and "▓ code" in line and "pinned" in line
    assert len(line.rstrip()) <= width
