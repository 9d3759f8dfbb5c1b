"""Fake agents for the dashboard tests: fixed readings, recorded actions, no sockets.

`reading(...)` builds a Reading with the numbers a test names; `FakeSource` serves one list of
readings per agent, one per poll (the last one repeats), and records defrag/resize calls.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from kvctl.api import (
    Alert,
    DefragResult,
    GpuMemory,
    Health,
    PoolMap,
    PoolSnapshot,
    ResizeRequest,
    ResizeResult,
)
from kvctl.client import AgentUnreachable
from kvctl.fleet import Reading

PAGE = 64 << 10
NOW = 1_800_000_000.0


def pool_snapshot(**numbers: Any) -> PoolSnapshot:
    """A 256-page pool of 64 KiB pages in 32-page segments, with `numbers` overriding."""
    base: dict[str, Any] = {
        "pool": "demo", "timestamp": NOW, "device": "cpu", "page_size": 16,
        "bytes_per_page": PAGE, "segment_pages": 32, "segments": 8, "capacity_pages": 256,
        "used_pages": 150, "cached_pages": 83, "free_pages": 23, "capacity_bytes": 256 * PAGE,
        "used_bytes": 150 * PAGE, "utilization_ratio": 0.91, "fragmentation_ratio": 0.62,
        "free_extents": 9, "largest_free_run": 5, "max_pool_pages": 1024,
        "alloc_attempts_total": 2000, "alloc_failures_total": 30, "alloc_success_ratio": 0.985,
        "window_seconds": 300.0, "prefix_cache_enabled": True,
        "prefix_queries_tokens_total": 10000, "prefix_hits_tokens_total": 4200,
        "prefix_hit_ratio": 0.42, "prefix_evictions_total": 17,
        "defrag_runs_total": {"manual": 1, "threshold": 3}, "defrag_pages_moved_total": 640,
        "defrag_active": False, "last_defrag": None, "last_defrag_age_seconds": None,
        "auto_defrag_enabled": True, "resizes_total": {"grow": 1}, "requests_running": 7,
        "requests_waiting": 2, "preemptions_total": 5,
        "gpus": [GpuMemory(index=0, name="H200", used_bytes=100 << 30, total_bytes=140 << 30)],
    }  # fmt: skip
    return PoolSnapshot.model_validate({**base, **numbers})


PAGE_MAP = PoolMap(
    capacity_pages=256,
    segment_pages=32,
    runs=[("used", 0, 100), ("free", 100, 10), ("cached", 110, 83), ("used", 193, 50),
          ("free", 243, 13)],
)  # fmt: skip

FIRING = Alert(
    name="KvctlFragmentationHigh", severity="critical", state="firing", value=0.62,
    summary="free pages are scattered: fragmentation 0.62",
    description="9 free extents", remediation="kvctl defrag --now",
    runbook_url="docs/alerts.md#kvctlfragmentationhigh", active_since=NOW - 120,
)  # fmt: skip
PENDING = FIRING.model_copy(
    update={"name": "KvctlPrefixHitRateLow", "severity": "warning", "state": "pending"}
)


def reading(agent: str = "http://node1:8477", **numbers: Any) -> Reading:
    health = Health(status="ok", pool="demo", version="0.1.0", uptime_seconds=3725.0)
    return Reading(
        agent=agent,
        health=health,
        pool=pool_snapshot(**numbers),
        alerts=(FIRING, PENDING),
        map=PAGE_MAP,
    )


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
        self.closed = False

    @property
    def agents(self) -> Sequence[str]:
        return list(self.readings)

    async def read(self) -> list[Reading]:
        index = self.polls
        self.polls += 1
        return [series[min(index, len(series) - 1)] for series in self.readings.values()]

    async def defrag(self, agent: str) -> DefragResult:
        self.defrags.append(agent)
        return DefragResult(
            trigger="manual", fragmentation_before=0.62, fragmentation_after=0.05,
            free_extents_before=9, free_extents_after=1, pages_moved=48,
            bytes_moved=48 * PAGE, seconds=0.012, complete=True,
        )  # fmt: skip

    async def resize(self, agent: str, request: ResizeRequest) -> ResizeResult:
        self.resizes.append((agent, request))
        new = request.pages or 256
        return ResizeResult(
            old_pages=256, new_pages=new, old_bytes=256 * PAGE, new_bytes=new * PAGE,
            direction="grow" if new > 256 else "shrink", pages_moved=0, pages_evicted=0,
        )  # fmt: skip

    async def close(self) -> None:
        self.closed = True


def screen_text(app) -> str:
    """The screen as plain text, as a terminal would show it (no colours).

    Reads the compositor, as Textual's own SVG screenshot does, since Textual has no public
    plain-text export.
    """
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True)
    update = app.screen._compositor.render_update(full=True, screen_stack=app._background_screens)
    console.print(update)
    return console.export_text()


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
        down=down,
        screen_text=screen_text,
        widget_text=widget_text,
        wait_until=wait_until,
    )
