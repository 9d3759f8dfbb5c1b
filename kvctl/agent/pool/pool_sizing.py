"""The pool's size in whole segments: adding free pages at the top of the id space, dropping
free ones there, and saying what stands in the way of a shrink.

A part of the pool, reached as `pool.sizing`: only a resize (`resize.PoolResizer`, which also
drives storage and the evacuation) changes the size, between two engine steps, so the page
arrays grow and shrink here and nowhere on the allocation paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvctl.agent.pool.errors import PoolError

if TYPE_CHECKING:
    from kvctl.agent.pool.page_pool import PagePool


class PoolSizing:
    """Grows and truncates its pool's page arrays (the same lists, in place, so every part
    keeps reading them) and sizes its growth reservations to the new capacity."""

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool

    @property
    def segments(self) -> int:
        """Whole segments the pool holds now (the unit of every resize)."""
        return self._pool.capacity // self._pool.segment_pages

    def grow(self, num_pages: int) -> None:
        """Add `num_pages` free pages at the top of the id space (whole segments)."""
        pool = self._pool
        if num_pages <= 0 or num_pages % pool.segment_pages:
            raise PoolError(
                f"grow by whole segments of {pool.segment_pages} pages, not {num_pages}"
            )
        old = pool.capacity
        pool._ref.extend([0] * num_pages)
        pool._ids.extend(range(old, old + num_pages))
        pool._cached.extend(bytes(num_pages))
        pool._owner.extend([None] * num_pages)
        pool.capacity = old + num_pages
        pool._free.give(old, num_pages)
        pool._reservations.fit(pool.capacity)

    def occupied_above(self, boundary: int) -> int:
        """Pages at or above `boundary` that are used or cached (what a shrink must move).

        Releases the reservations first: they hold nothing and a shrink drops them anyway.
        """
        pool = self._pool
        self.release_reservations()
        pool._loose.settle()
        free_above = sum(
            min(length, start + length - boundary)
            for start, length in pool._free.runs()
            if start + length > boundary
        )
        return max(0, pool.capacity - boundary) - free_above

    def truncate(self, new_capacity: int) -> None:
        """Drop the pages from `new_capacity` up, which must all be free."""
        pool = self._pool
        if new_capacity % pool.segment_pages or not 0 < new_capacity <= pool.capacity:
            raise PoolError(f"truncate to whole segments of {pool.segment_pages} pages")
        if self.occupied_above(new_capacity):
            raise PoolError(f"truncate: pages at or above {new_capacity} are still occupied")
        if new_capacity == pool.capacity:
            return
        pool._free.take_range(new_capacity, pool.capacity - new_capacity)
        del pool._ref[new_capacity:]
        del pool._ids[new_capacity:]
        del pool._cached[new_capacity:]
        del pool._owner[new_capacity:]
        pool.capacity = new_capacity
        pool._reservations.fit(new_capacity)

    def release_reservations(self) -> int:
        """Return every reserved page to the free extents (before a shrink); how many."""
        return self._pool._reservations.release_all()
