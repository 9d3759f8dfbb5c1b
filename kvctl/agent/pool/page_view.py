"""Page by page readings of a pool: one page's state and reference count, the free runs, the
page map.

A part of the pool, reached as `pool.pages`: the page map, the prefix cache's checks, tests and
benchmarks read pages one by one or all at once, the allocation paths never do, so these
readings stand apart from the pool's own counters (`free_pages`, `used_pages`, `stats()`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvctl.agent.pool.stats import PageRun, PageState, PageStates

if TYPE_CHECKING:
    from kvctl.agent.pool.page_pool import PagePool


class PageView:
    """Reads its pool's pages (the free runs are filed first, nothing else changes)."""

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool

    def refcount(self, page: int) -> int:
        """How many page tables hold `page`."""
        return self._pool._ref[page]

    def state(self, page: int) -> PageState:
        """Used (some table holds it), cached (only the prefix cache does) or free."""
        pool = self._pool
        if pool._ref[page]:
            return PageState.USED
        if pool._cached[page]:
            return PageState.CACHED
        return PageState.FREE

    def is_occupied(self, page: int) -> bool:
        """Used or cached: what a defragmentation or a shrink has to move."""
        return bool(self._pool._ref[page] or self._pool._cached[page])

    def free_runs(self) -> list[tuple[int, int]]:
        """Free extents as (start, length), in increasing page order (reserved pages apart)."""
        self._pool._loose.settle()
        return list(self._pool._free.runs())

    def map(self) -> list[PageRun]:
        """Every page's state, run-length encoded, in page order."""
        return self.states().runs()

    def states(self) -> PageStates:
        """A copy of every page's state, cheap to take (see `PageStates`)."""
        pool = self._pool
        return PageStates(pool.capacity, pool.segment_pages, pool._ref.copy(), bytes(pool._cached))
