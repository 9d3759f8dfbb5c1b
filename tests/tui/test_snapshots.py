"""Text snapshots of every view at the smallest terminal we support (80×24) and a large one.

One fixed fleet (three agents, one down, alerts with the longest names), a minute of polls on
a clock of five seconds a poll, no toasts: the text depends on nothing but the code. Set
KVCTL_UPDATE_SNAPSHOTS=1 to rewrite the files after a deliberate change, then review the diff.
"""

from __future__ import annotations

import re

import pytest

from kvctl.tui.app import TopApp
from kvctl.tui.detail import DetailScreen
from kvctl.tui.screens import AlertsScreen, HelpScreen

pytestmark = pytest.mark.anyio

A, B, C = (f"http://node{i}:8477" for i in range(1, 4))
SIZES = [(80, 24), (160, 45)]
POLLS = 13
STEP = 5.0  # seconds a poll: the thirteen readings span the last minute


def scenario(fakes) -> dict:
    """node1 busy, its utilisation climbing, with three alerts; node2 down; node3 in trouble."""
    long_names = [
        fakes.alert("KvctlGpuMemoryNearCapacity"),
        fakes.alert("KvctlPrefixHitRateLow", state="pending"),
    ]
    node1 = []
    for i in range(POLLS):
        used = 60 + 7 * i
        free = 173 - used
        node1.append(
            fakes.reading(
                A,
                alerts=[fakes.alert("KvctlFragmentationHigh", "critical"), *long_names],
                used_pages=used,
                free_pages=free,
                largest_free_run=free // (1 + i % 4),
            )
        )
    trouble = [
        fakes.alert("KvctlAllocationFailures", "critical"),
        fakes.alert("KvctlPoolNearlyFull"),
        fakes.alert("KvctlPreemptionStorm"),
    ]
    node3 = fakes.reading(
        C, alerts=trouble, used_pages=240, free_pages=0, cached_pages=16, alloc_success_ratio=0.9
    )
    return {A: node1, B: [fakes.down(B)], C: [node3]}


RENDERED: dict[tuple[int, int], dict[str, str]] = {}


async def shown(fakes, view: str, size: tuple[int, int]) -> str:
    """The screen text of `view` at `size`; every view of a size comes from one app run."""
    if size not in RENDERED:
        RENDERED[size] = await render(fakes, size)
    return RENDERED[size][view]


async def render(fakes, size: tuple[int, int]) -> dict[str, str]:
    """The fleet table, then node1's detail, its help and its alerts."""
    app: TopApp = fakes.make_app(scenario(fakes), step=STEP)
    views: dict[str, str] = {}
    async with app.run_test(size=size) as pilot:
        await fakes.polled(app, pilot, POLLS)
        views["fleet"] = fakes.screen_text(app)
        for view, key, screen in [
            ("main", "enter", DetailScreen),
            ("help", "question_mark", HelpScreen),
            ("alerts", "a", AlertsScreen),
        ]:
            await pilot.press(key)
            await pilot.pause()
            assert isinstance(app.screen, screen)
            views[view] = fakes.screen_text(app)
            if view == "help":
                await pilot.press("escape")
    return views


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
@pytest.mark.parametrize("view", ["fleet", "main", "help", "alerts"])
async def test_snapshot(fakes, view: str, size: tuple[int, int]) -> None:
    text = await shown(fakes, view, size)
    assert len(text.splitlines()) == size[1]
    fakes.check_snapshot(f"{view}_{size[0]}x{size[1]}", text)


NAMES = (
    "KvctlFragmentationHigh",
    "KvctlGpuMemoryNearCapacity",
    "KvctlPrefixHitRateLow",
    "KvctlAllocationFailures",
    "KvctlPoolNearlyFull",
    "KvctlPreemptionStorm",
)


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
@pytest.mark.parametrize("view", ["fleet", "main", "alerts"])
async def test_alert_names_are_whole_or_cut_with_an_ellipsis(
    fakes, view: str, size: tuple[int, int]
) -> None:
    text = await shown(fakes, view, size)
    found = re.findall(r"Kvctl[A-Za-z]*…?", text)
    assert found
    for name in found:
        assert name in NAMES or (
            name.endswith("…") and any(n.startswith(name[:-1]) for n in NAMES)
        ), f"{name!r} is broken across lines"
