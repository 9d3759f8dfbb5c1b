"""At 80×24, the smallest terminal we support: nothing is cut off or covered."""

from __future__ import annotations

import pytest
from textual.containers import VerticalScroll
from textual.widgets._toast import Toast

from kvctl.tui.screens import HelpScreen

pytestmark = pytest.mark.anyio

A, B = "http://node1:8477", "http://node2:8477"
SMALL = (80, 24)


async def test_the_help_fits_the_width_and_scrolls_to_its_end(fakes) -> None:
    app = fakes.make_app({A: [fakes.reading(A)]})
    async with app.run_test(size=SMALL) as pilot:
        await fakes.polled(app, pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        box = app.screen.query_one(VerticalScroll)
        assert box.region.right <= SMALL[0] and box.region.bottom <= SMALL[1]
        last = "fleet table, with why."  # the end of the help's last line
        assert last not in fakes.screen_text(app)  # the help is longer than the screen…
        await pilot.press("end")
        await pilot.pause()
        assert last in fakes.screen_text(app)  # …and scrolls to its end
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@pytest.mark.parametrize("fleet", [False, True], ids=["detail", "fleet"])
async def test_toasts_leave_the_status_line_and_footer_visible(fakes, fleet: bool) -> None:
    agents = {A: [fakes.reading(A)], B: [fakes.reading(B)]} if fleet else {A: [fakes.reading(A)]}
    app = fakes.make_app(agents)
    async with app.run_test(size=SMALL, notifications=True) as pilot:
        await fakes.polled(app, pilot)
        app.say("defrag: fragmentation 0.78 → 0.05, 48 pages moved in 12 ms on a long line")
        await fakes.wait_until(pilot, lambda: bool(app.screen.query(Toast)))
        await pilot.pause()
        lines = fakes.screen_text(app).splitlines()
    assert "▌" in "".join(lines[-8:-2])  # the toast is there, above…
    assert lines[-1].strip().endswith("? help  q quit")  # …the footer…
    status = "in the order given" if fleet else app.message
    assert lines[-2].strip() == status  # …and the status line, whole
