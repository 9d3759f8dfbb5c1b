"""Immutable snapshots of a pool's state: what every reader outside the pool sees.

The server, the metrics exporter, the alert evaluator and the simulator read these snapshots and
never the pool's internals, so the pool can change its data structures without touching them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import numpy as np


class PageState(StrEnum):
    """The state of one page (docs/architecture.md): free, used, or held only by the cache."""

    FREE = "free"
    USED = "used"  # held by at least one running sequence
    CACHED = "cached"  # held only by the prefix cache, evictable


def fragmentation_ratio(largest_free_run: int, free_pages: int) -> float:
    """1 - largest free run / free pages; 0 when nothing is free."""
    if free_pages == 0:
        return 0.0
    return 1.0 - largest_free_run / free_pages


@dataclass(frozen=True)
class PoolStats:
    """One consistent reading of a pool's occupancy, fragmentation and allocation counters."""

    page_size: int
    bytes_per_page: int
    segment_pages: int
    segments: int
    capacity_pages: int
    used_pages: int
    cached_pages: int
    free_pages: int
    free_extents: int
    largest_free_run: int
    sequences: int
    alloc_attempts: int
    alloc_failures: int
    contiguous_misses: int
    reserved_pages: int = 0  # free pages set aside for running sequences' next pages

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.bytes_per_page

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.bytes_per_page

    @property
    def utilization_ratio(self) -> float:
        """(used + cached) / capacity."""
        if self.capacity_pages == 0:
            return 0.0
        return (self.used_pages + self.cached_pages) / self.capacity_pages

    @property
    def pressure_ratio(self) -> float:
        """used / capacity: cached pages are evicted on demand, so they count as free."""
        if self.capacity_pages == 0:
            return 0.0
        return self.used_pages / self.capacity_pages

    @property
    def free_run_pages(self) -> int:
        """Free pages in the free extents: all free pages but those reserved for growth, which
        follow their sequences by design and go back to any allocation that needs them."""
        return self.free_pages - self.reserved_pages

    @property
    def fragmentation_ratio(self) -> float:
        """Over the free extents (`free_run_pages`)."""
        return fragmentation_ratio(self.largest_free_run, self.free_run_pages)

    def to_dict(self) -> dict[str, Any]:
        """Plain fields plus the derived ratios and byte counts, for JSON."""
        data = asdict(self)
        data.update(
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes,
            utilization_ratio=self.utilization_ratio,
            fragmentation_ratio=self.fragmentation_ratio,
        )
        return data


@dataclass(frozen=True)
class PageRun:
    """`length` consecutive pages from `start`, all in `state` (one entry of the run-length map)."""

    state: PageState
    start: int
    length: int


_STATE_NAMES = (PageState.FREE, PageState.USED, PageState.CACHED)


@dataclass(frozen=True)
class PageStates:
    """Every page's state, copied out of the pool with a few memory copies (no Python work per
    page), so the engine thread can take it between two decode steps and another thread can
    run-length encode it, which is O(capacity)."""

    capacity: int
    segment_pages: int
    refcounts: list[int]  # per page: how many page tables hold it
    cached: bytes  # per page: 1 when the prefix cache holds it

    def runs(self) -> list[PageRun]:
        """The states run-length encoded, in page order."""
        if not self.capacity:
            return []
        used = np.array(self.refcounts, dtype=np.int64) > 0
        cached = np.frombuffer(self.cached, dtype=np.uint8) > 0
        states = np.where(used, 1, np.where(cached, 2, 0))
        starts = np.concatenate(([0], np.flatnonzero(np.diff(states)) + 1))
        lengths = np.diff(np.append(starts, self.capacity))
        return [
            PageRun(_STATE_NAMES[state], start, length)
            for state, start, length in zip(
                states[starts].tolist(), starts.tolist(), lengths.tolist(), strict=True
            )
        ]
