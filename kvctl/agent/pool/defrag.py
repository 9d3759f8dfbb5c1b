"""Compaction of a pool's occupied pages toward the lowest ids.

A move copies a page's K/V to a free page, switches every page-table entry (and the prefix
cache's reference) to the new page, then frees the old one. Because the switch happens between
two decode steps and the contents are identical, a model mid-generation cannot tell.

Plan: with `U` occupied pages, a fully compacted pool holds them in `[0, U)`. Every occupied page
at or above the boundary moves into a free page below it: the highest sources first (so the tail
empties first, which is what a shrink needs) into the lowest holes first. That is the minimum
number of moves, and after them the free space is one run: fragmentation 0. (Pages reserved for
a sequence's growth hold nothing: the plan releases those it meets instead of moving them.)

Work is cut into batches bounded by a page count and a time budget, so the engine can interleave
defragmentation with decode steps; each batch is complete (copied and switched) before the next,
so stopping between batches loses nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from kvctl.agent.pool.page_pool import PagePool


class DefragTrigger(StrEnum):
    """Why a defragmentation ran (the `trigger` label of `kvctl_defrag_runs_total`)."""

    MANUAL = "manual"
    THRESHOLD = "threshold"
    EXTENTS = "extents"
    ALLOC_FAILURE = "alloc_failure"
    SHRINK = "shrink"


@dataclass(frozen=True, slots=True, kw_only=True)
class DefragReport:
    """What one defragmentation did (or one session of them, accumulated): the pool's own
    reading, which `kvctl.agent.api_views.defrag_view` turns into the API's `DefragResult`."""

    trigger: DefragTrigger
    fragmentation_before: float
    fragmentation_after: float
    free_extents_before: int
    free_extents_after: int
    pages_moved: int
    bytes_moved: int
    seconds: float
    complete: bool


class PageCopier(Protocol):
    """Whatever holds page contents: copies pages `src[i]` to `dst[i]` in one batch."""

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None: ...


def plan_moves(pool: PagePool, limit: int, boundary: int | None = None) -> list[tuple[int, int]]:
    """Up to `limit` (src, dst) moves toward compaction (below `boundary`, if given).

    The highest occupied pages go into the lowest free pages, as long as each move goes down;
    then every hole is below every source, so they can be paired in ascending order: a run of
    a sequence's pages lands as a run, and destinations ascend within each free run (the order
    `Relocation.relocate` serves in O(1)). Free runs come lowest first off a heap and sources
    are found by walking down from the top, so the cost follows the pages moved, not the pool
    size or the number of sequences.
    """
    if limit <= 0:
        return []
    floor = 0 if boundary is None else boundary
    ceiling = pool.capacity if boundary is None else boundary
    relocation = pool.relocation
    sources: list[int] = []
    src = relocation.highest_occupied(pool.capacity)
    while src >= floor and len(sources) < limit:
        sources.append(src)
        src = relocation.highest_occupied(src)
    if not sources:
        return []
    runs = relocation.lowest_free_runs()
    try:
        holes = _holes_below(runs, sources, ceiling)
    finally:
        if isinstance(runs, Generator):  # stopped early: its cleanup restores the run heap
            runs.close()
    return list(zip(reversed(sources[: len(holes)]), holes, strict=True))


def _holes_below(runs: Iterable[tuple[int, int]], sources: list[int], ceiling: int) -> list[int]:
    """Free pages lowest first, each below the source it pairs with and below `ceiling`."""
    holes: list[int] = []
    for start, length in runs:
        for hole in range(start, start + length):
            i = len(holes)
            if i == len(sources) or hole >= sources[i] or hole >= ceiling:
                return holes
            holes.append(hole)
    return holes


def is_compact(pool: PagePool, boundary: int | None = None) -> bool:
    """No page left to move: nothing occupied at or above `boundary`, or (without one) no free
    page below the highest occupied page."""
    if boundary is not None:
        return pool.relocation.highest_occupied(pool.capacity) < boundary
    return not plan_moves(pool, 1)


def moves_needed(pool: PagePool, boundary: int | None = None) -> int:
    """How many page moves a full compaction (below `boundary`) still needs."""
    if boundary is None:
        boundary = pool.capacity - pool.free_pages
    return pool.sizing.occupied_above(boundary)


class Defragmenter:
    """Applies planned moves in bounded batches: copy contents, switch references, free old."""

    def __init__(
        self,
        pool: PagePool,
        copier: PageCopier | None = None,
        batch_pages: int = 1024,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.pool = pool
        self.copier = copier
        self.batch_pages = batch_pages
        self.clock = clock

    def step(self, max_pages: int, boundary: int | None = None) -> int:
        """Move at most `max_pages` pages as one batch; return how many moved (0 when done)."""
        moves = plan_moves(self.pool, max_pages, boundary)
        if not moves:
            return 0
        if self.copier is not None:
            self.copier.copy_pages([s for s, _ in moves], [d for _, d in moves])
        self.pool.relocation.relocate(moves)
        return len(moves)

    def run(
        self,
        trigger: DefragTrigger,
        max_pages: int | None = None,
        max_seconds: float | None = None,
        boundary: int | None = None,
    ) -> DefragReport:
        """Compact until done or a budget (pages, seconds) is spent; report the effect.

        With no budget it runs to completion: fragmentation 0 (or, with `boundary`, nothing
        occupied at or above it).
        """
        before = self.pool.stats()
        started = self.clock()
        moved = 0
        complete = False
        while True:
            room = (
                self.batch_pages if max_pages is None else min(self.batch_pages, max_pages - moved)
            )
            if room <= 0:
                break
            n = self.step(room, boundary)
            moved += n
            if n == 0:
                complete = True
                break
            if max_seconds is not None and self.clock() - started >= max_seconds:
                break
        if not complete:
            complete = is_compact(self.pool, boundary)
        after = self.pool.stats()
        return DefragReport(
            trigger=DefragTrigger(trigger),
            fragmentation_before=before.fragmentation_ratio,
            fragmentation_after=after.fragmentation_ratio,
            free_extents_before=before.free_extents,
            free_extents_after=after.free_extents,
            pages_moved=moved,
            bytes_moved=moved * self.pool.bytes_per_page,
            seconds=self.clock() - started,
            complete=complete,
        )
