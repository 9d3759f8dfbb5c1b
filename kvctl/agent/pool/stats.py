"""Immutable readings of a pool: what every reader outside the pool sees.

`PoolOccupancy` is the pool's occupancy reading (its `stats()`): plain frozen data, with the
ratios and byte counts derived from the page counts by `kvctl.occupancy`, the functions the
API's model of the same name computes them with. The pool core knows nothing of the API:
`kvctl.agent.api_views` is the one place that turns these readings into wire objects. Here too
are the page-by-page states behind the page map. The server, the metrics exporter, the alert
evaluator and the simulator read these and never the pool's internals, so the pool can change
its data structures without touching them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from kvctl.occupancy import (
    fragmentation_of,
    free_run_pages_of,
    pages_bytes,
    pressure_of,
    utilization_of,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolOccupancy:
    """One consistent reading of a pool's pages and allocation counters.

    `reserved_pages` are free pages set aside, right after a running sequence's last page, for
    its next ones; they are part of `free_pages`, and `fragmentation_ratio`, `free_extents` and
    `largest_free_run` describe the free pages apart from them (`free_run_pages`).
    """

    page_size: int  # tokens one page holds
    bytes_per_page: int  # K and V of `page_size` tokens over every layer
    segment_pages: int  # the unit of resize
    segments: int
    capacity_pages: int
    used_pages: int  # held by at least one running sequence
    cached_pages: int  # held only by the prefix cache
    free_pages: int  # free, the reserved pages included
    free_extents: int  # runs of consecutive free pages (reserved pages apart)
    largest_free_run: int
    reserved_pages: int = 0
    sequences: int = 0  # page tables: running sequences and their forks
    alloc_attempts_total: int
    alloc_failures_total: int  # failed after eviction and growth were tried
    contiguous_misses_total: int = 0  # prompts that got scattered pages instead of one run

    @property
    def capacity_bytes(self) -> int:
        return pages_bytes(self.capacity_pages, self.bytes_per_page)

    @property
    def used_bytes(self) -> int:
        return pages_bytes(self.used_pages, self.bytes_per_page)

    @property
    def utilization_ratio(self) -> float:
        """(used + cached) / capacity."""
        return utilization_of(self.used_pages, self.cached_pages, self.capacity_pages)

    @property
    def pressure_ratio(self) -> float:
        """used / capacity: how close the pool is to refusing."""
        return pressure_of(self.used_pages, self.capacity_pages)

    @property
    def free_run_pages(self) -> int:
        """Free pages but those reserved for growth."""
        return free_run_pages_of(self.free_pages, self.reserved_pages)

    @property
    def fragmentation_ratio(self) -> float:
        """1 - largest free run / free pages, over the free extents (`free_run_pages`)."""
        return fragmentation_of(self.largest_free_run, self.free_run_pages)


class PageState(StrEnum):
    """The state of one page (docs/architecture.md): free, used, or held only by the cache."""

    FREE = "free"
    USED = "used"  # held by at least one running sequence
    CACHED = "cached"  # held only by the prefix cache, evictable
    WINDOW = "window"  # used, by a sliding-window layer group (a map's view of used pages)


@dataclass(frozen=True)
class PageRun:
    """`length` consecutive pages from `start`, all in `state` (one entry of the run-length map)."""

    state: PageState
    start: int
    length: int


_STATE_NAMES = (PageState.FREE, PageState.USED, PageState.CACHED, PageState.WINDOW)


@dataclass(frozen=True)
class PageStates:
    """Every page's state, copied out of the pool with a few memory copies (no Python work per
    page), so the engine thread can take it between two decode steps and another thread can
    run-length encode it, which is O(capacity)."""

    capacity: int
    segment_pages: int
    refcounts: list[int]  # per page: how many page tables hold it
    cached: bytes  # per page: 1 when the prefix cache holds it
    window: bytes = b""  # per page: 1 when a sliding-window group's table holds it (or empty)

    def runs(self) -> list[PageRun]:
        """The states run-length encoded, in page order."""
        if not self.capacity:
            return []
        used = np.array(self.refcounts, dtype=np.int64) > 0
        cached = np.frombuffer(self.cached, dtype=np.uint8) > 0
        states = np.where(used, 1, np.where(cached, 2, 0))
        if self.window:
            states = np.where(used & (np.frombuffer(self.window, dtype=np.uint8) > 0), 3, states)
        starts = np.concatenate(([0], np.flatnonzero(np.diff(states)) + 1))
        lengths = np.diff(np.append(starts, self.capacity))
        return [
            PageRun(_STATE_NAMES[state], start, length)
            for state, start, length in zip(
                states[starts].tolist(), starts.tolist(), lengths.tolist(), strict=True
            )
        ]
