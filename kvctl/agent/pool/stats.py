"""Immutable readings of a pool's pages: what every reader outside the pool sees.

The pool's occupancy reading is the API's `PoolOccupancy` itself (one definition of its fields
and ratios, from the pool to the JSON); here are the page-by-page states behind the page map.
The server, the metrics exporter, the alert evaluator and the simulator read these and never
the pool's internals, so the pool can change its data structures without touching them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from kvctl.api import PoolOccupancy as PoolOccupancy


class PageState(StrEnum):
    """The state of one page (docs/architecture.md): free, used, or held only by the cache."""

    FREE = "free"
    USED = "used"  # held by at least one running sequence
    CACHED = "cached"  # held only by the prefix cache, evictable


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
