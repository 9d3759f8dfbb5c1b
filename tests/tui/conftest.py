"""Fake agents for the dashboard tests: fixed readings, recorded actions, no sockets.

`reading(...)` builds a Reading with the numbers a test names; `FakeSource` serves one list of
readings per agent, one per poll (the last one repeats), and records defrag/resize calls.
`make_app` gives the dashboard a clock that advances one second per poll, so the screen (ages,
sparklines) depends on what was polled, never on when the test ran.
"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pool_readings import pool_snapshot as shared_pool_snapshot
from rich.console import Console

from kvctl.api import (
    Alert,
    DefragResult,
    GpuMemory,
    Health,
    PoolMap,
    PoolShare,
    PoolSnapshot,
    ResizeRequest,
    ResizeResult,
)
from kvctl.client import AgentUnreachable
from kvctl.fleet import Reading
from kvctl.tui.app import TopApp

PAGE = 64 << 10
SNAPSHOTS = Path(__file__).parent / "snapshots"
NOW = 1_800_000_000.0


DASHBOARD_POOL: dict[str, Any] = dict(
    timestamp=NOW, bytes_per_page=PAGE, segment_pages=32, capacity_pages=256, used_pages=150,
    cached_pages=83, free_extents=9, largest_free_run=5, max_pool_pages=1024,
    alloc_attempts_total=2000, alloc_failures_total=30, alloc_success_ratio=0.985,
    prefix_hits_tokens_total=4200, prefix_hit_ratio=0.42, prefix_evictions_total=17,
    defrag_runs_total={"manual": 1, "threshold": 3}, defrag_pages_moved_total=640,
    resizes_total={"grow": 1}, requests_running=7, requests_waiting=2, preemptions_total=5,
    gpus=[GpuMemory(index=0, name="H200", used_bytes=100 << 30, total_bytes=140 << 30)],
)  # fmt: skip
"""A busy 256-page pool of 64 KiB pages in 32-page segments: 150 used, 83 cached, 23 free in
9 runs, the largest 5 pages long."""


def pool_snapshot(**numbers: Any) -> PoolSnapshot:
    """The dashboard's pool with `numbers` changed (ratios follow from the page counts)."""
    return shared_pool_snapshot(**{**DASHBOARD_POOL, **numbers})


PAGE_MAP = PoolMap(
    capacity_pages=256,
    segment_pages=32,
    runs=[("used", 0, 100), ("free", 100, 10), ("cached", 110, 83), ("used", 193, 50),
          ("free", 243, 13)],
)  # fmt: skip

FIRING = Alert(
    name="KvctlFragmentationHigh", severity="critical", state="firing", value=0.78,
    summary="free pages are scattered: fragmentation 0.78",
    description="9 free extents", remediation="kvctl defrag --now",
    runbook_url="docs/alerts.md#kvctlfragmentationhigh", active_since=NOW - 120,
)  # fmt: skip
PENDING = FIRING.model_copy(
    update={"name": "KvctlPrefixHitRateLow", "severity": "warning", "state": "pending"}
)


def reading(
    agent: str = "http://node1:8477", alerts: Sequence[Alert] = (FIRING, PENDING), **numbers: Any
) -> Reading:
    """An agent that answered: the 256-page pool of `pool_snapshot(**numbers)` and `alerts`.

    The ratios are computed from the page counts, so a test changes `used_pages`,
    `largest_free_run`, … rather than the ratios."""
    health = Health(status="ok", pool="demo", version="0.1.0", uptime_seconds=3725.0)
    return Reading(
        agent=agent,
        health=health,
        pool=pool_snapshot(**numbers),
        alerts=tuple(alerts),
        map=PAGE_MAP,
    )


BUDGET = 48 << 20


def share(**fields: Any) -> PoolShare:
    """A pool's place in a 48 MiB budget of two pools, 40 MiB assigned, with `fields` changed."""
    base: dict[str, Any] = dict(
        budget_bytes=BUDGET, assigned_bytes=40 << 20, floor_pages=32, ceiling_pages=512,
        pools_total=2, reclaimable_pages=0,
    )  # fmt: skip
    return PoolShare(**{**base, **fields})


def pools_reading(agent: str = "http://node1:8477", **numbers: Any) -> Reading:
    """An agent serving two models in a 48 MiB budget: `chat` (the dashboard's 16 MiB pool,
    under pressure, two moves in) shown with its map, and `code` (24 MiB of 128 KiB pages,
    pinned by a resize, two moves out); each pool with an alert of its own."""
    chat = pool_snapshot(
        pool="chat",
        share=share(
            under_pressure=True, short_pages=12, pools_under_pressure=1,
            rebalances_total={"in": 2, "out": 0}, rebalanced_bytes_total={"in": 4 << 20},
        ),
        **numbers,
    )  # fmt: skip
    code = pool_snapshot(
        pool="code", bytes_per_page=128 << 10, capacity_pages=192, used_pages=40,
        cached_pages=20, free_extents=2, largest_free_run=100, requests_running=1,
        requests_waiting=0,
        share=share(
            pinned=True, reclaimable_pages=96, rebalances_total={"in": 0, "out": 2},
            rebalanced_bytes_total={"out": 4 << 20},
        ),
    )  # fmt: skip
    alerts = (
        FIRING.model_copy(update={"labels": {"pool": "chat"}}),
        PENDING.model_copy(update={"labels": {"pool": "code"}}),
    )
    return Reading(
        agent=agent,
        health=Health(status="ok", pool="chat", version="0.1.0", uptime_seconds=3725.0),
        pool=chat,
        alerts=alerts,
        map=PAGE_MAP.model_copy(update={"pool": chat}),
        pools=(chat, code),
        budget_bytes=BUDGET,
        assigned_bytes=40 << 20,
    )


def alert(name: str, severity: str = "warning", state: str = "firing") -> Alert:
    """Another alert like FIRING, named `name`."""
    return FIRING.model_copy(update={"name": name, "severity": severity, "state": state})


def down(agent: str = "http://node1:8477") -> Reading:
    return Reading(
        agent=agent,
        error=AgentUnreachable(agent, f"cannot reach agent at {agent}", "connection refused"),
    )


class FakeSource:
    """Serves `readings[agent][i]` on the i-th poll; records the actions taken."""

    def __init__(self, readings: dict[str, Sequence[Reading]]) -> None:
        self.readings = readings
        self.polls = 0
        self.defrags: list[str] = []
        self.resizes: list[tuple[str, ResizeRequest]] = []
        self.pools_asked: list[dict[str, str]] = []
        """The pools the app asked to be shown, poll by poll."""
        self.acted_on: list[str | None] = []
        """The pool of each defrag and resize (None: the agent's only pool)."""
        self.focus_asked: list[str | None] = []
        """The agent on the detail screen at each poll (None: the fleet table)."""
        self.closed = False
        self.fleet_first = False

    @property
    def agents(self) -> Sequence[str]:
        return list(self.readings)

    async def read(
        self, pools: Mapping[str, str] | None = None, focus: str | None = None
    ) -> list[Reading]:
        index = self.polls
        self.polls += 1
        self.pools_asked.append(dict(pools or {}))
        self.focus_asked.append(focus)
        return [series[min(index, len(series) - 1)] for series in self.readings.values()]

    async def defrag(self, agent: str, pool: str | None = None) -> DefragResult:
        self.defrags.append(agent)
        self.acted_on.append(pool)
        return DefragResult(
            trigger="manual", fragmentation_before=0.62, fragmentation_after=0.05,
            free_extents_before=9, free_extents_after=1, pages_moved=48,
            bytes_moved=48 * PAGE, seconds=0.012, complete=True,
        )  # fmt: skip

    async def resize(
        self, agent: str, request: ResizeRequest, pool: str | None = None
    ) -> ResizeResult:
        self.resizes.append((agent, request))
        self.acted_on.append(pool)
        new = request.pages or 256
        return ResizeResult(
            old_pages=256, new_pages=new, old_bytes=256 * PAGE, new_bytes=new * PAGE,
            direction="grow" if new > 256 else "shrink", pages_moved=0, pages_evicted=0,
            pinned=pool is not None,  # a named pool is one of a budget, which the resize pins
        )  # fmt: skip

    async def close(self) -> None:
        self.closed = True


def make_app(
    readings: dict[str, Sequence[Reading]], readonly: bool = False, step: float = 1.0
) -> TopApp:
    """An app that polls only when told (a long interval), on a clock of `step` s a poll."""
    source = FakeSource(readings)
    clock = lambda: NOW + step * source.polls  # noqa: E731
    return TopApp(source, interval=3600, readonly=readonly, clock=clock)


async def polled(app: TopApp, pilot, count: int = 1) -> None:
    """Wait until `count` polls (the first one at start included) have finished."""
    while app.source.polls < count or not app._poll_worker.is_finished:
        app.poll()  # starts one only when none is running
        await pilot.pause(0.01)
    await pilot.pause()


def screen_text(app) -> str:
    """The screen as plain text, as a terminal would show it (no colours).

    Reads the compositor, as Textual's own SVG screenshot does, since Textual has no public
    plain-text export.
    """
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True)
    update = app.screen._compositor.render_update(full=True, screen_stack=app._background_screens)
    console.print(update)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def check_snapshot(name: str, text: str) -> None:
    """`text` must equal snapshots/`name`.txt; KVCTL_UPDATE_SNAPSHOTS=1 rewrites the file
    instead (after a deliberate change; review the diff)."""
    path = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("KVCTL_UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path.name} differs; the screen now reads:\n{text}"


def widget_text(widget, width: int = 100) -> str:
    """What a widget's render() shows, at `width` columns."""
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(widget.render())
    return console.export_text()


async def wait_until(pilot, condition: Callable[[], bool], timeout: float = 15.0) -> None:
    """Let the app run until `condition()` holds; fail after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("the dashboard did not get there in time")
        await pilot.pause(0.05)


@pytest.fixture
def fakes() -> SimpleNamespace:
    """The helpers above, for test modules (conftest modules are not imported by name)."""
    return SimpleNamespace(
        FakeSource=FakeSource,
        reading=reading,
        pools_reading=pools_reading,
        down=down,
        alert=alert,
        make_app=make_app,
        polled=polled,
        screen_text=screen_text,
        check_snapshot=check_snapshot,
        widget_text=widget_text,
        wait_until=wait_until,
    )
