"""Growing and shrinking a pool by whole segments.

Grow: storage allocates the new segments first (if the device is out of memory nothing changed),
then the pool adds their pages as one free run at the top.

Shrink: refuse before touching anything if the pages in use do not fit the new size, or if an
admitted request could no longer finish in it (`promised`: the engine admits only requests whose
prompt plus max_tokens fits the pool, and a shrink must not break that promise); otherwise
evict cached pages that would not fit, evacuate every occupied page above the new size into free
pages below it (a defragmentation with the new size as boundary), and only then drop the tail
pages and release the storage segments. An interruption before the release leaves a valid,
larger pool; nothing is ever released while it still holds a page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvctl.agent.pool.defrag import Defragmenter, DefragReport, DefragTrigger
from kvctl.agent.pool.errors import ResizeRefused
from kvctl.agent.pool.page_pool import PagePool
from kvctl.units import format_bytes


class SegmentStore(Protocol):
    """Storage that can add segments at the top and release them from the top."""

    def add_segments(self, count: int) -> None: ...

    def release_segments(self, count: int) -> None: ...


@dataclass(frozen=True)
class ResizeResult:
    """Capacity before and after a resize, and the evacuation it needed."""

    old_pages: int
    new_pages: int
    pages_moved: int
    pages_evicted: int

    @property
    def direction(self) -> str:
        if self.new_pages > self.old_pages:
            return "grow"
        return "shrink" if self.new_pages < self.old_pages else "none"


class PoolResizer:
    """Changes a pool's capacity to a number of pages, rounded up to whole segments."""

    def __init__(
        self,
        pool: PagePool,
        defragmenter: Defragmenter,
        storage: SegmentStore | None = None,
        min_pages: int | None = None,
        max_pages: int | None = None,
        promised: Callable[[], int] | None = None,
        room: Callable[[], int] | None = None,
    ) -> None:
        self.pool = pool
        self.room = room  # bytes a shared budget lets the pool grow by (None: no budget)
        self.promised = promised
        self.pinned: Callable[[], int] | None = None  # pages pinned prefixes hold
        self.defragmenter = defragmenter
        self.storage = storage
        self.min_pages = min_pages or pool.segment_pages
        self.max_pages = max_pages
        self.last_evacuation: DefragReport | None = None

    def round_to_segments(self, pages: int) -> int:
        seg = self.pool.segment_pages
        return -(-pages // seg) * seg

    def _asked(self, pages: int, target: int) -> str:
        """What was asked, in the words of a refusal: the rounding named when there was one,
        so the number refused is one the operator can trace to what they typed."""
        if target == pages:
            return f"{pages:,} pages"
        return (
            f"{pages:,} pages (rounded up to {target:,}, whole segments of "
            f"{self.pool.segment_pages:,} pages)"
        )

    def check(self, pages: int, floor: int | None = None) -> int:
        """The capacity a resize to `pages` would give; raises `ResizeRefused` if it cannot.
        `floor` replaces `min_pages` (a model put to sleep goes down to one segment)."""
        pool = self.pool
        target = self.round_to_segments(pages)
        asked = self._asked(pages, target)
        least = self.min_pages if floor is None else floor
        if pages < 1 or target < least:
            raise ResizeRefused(
                f"the pool cannot be smaller than {least:,} pages; asked for {pages:,}"
            )
        if self.max_pages is not None and target > self.max_pages:
            raise ResizeRefused(
                f"{asked} is above the maximum of {self.max_pages:,} pages; "
                "raise --max-pool-pages to allow it"
            )
        if target > pool.capacity and self.room is not None:
            extra, room = (target - pool.capacity) * pool.bytes_per_page, self.room()
            if extra > room:
                raise ResizeRefused(
                    f"{asked} needs {format_bytes(extra)} more and the KV budget the pools "
                    f"share has {format_bytes(room)} unassigned; shrink another pool first or "
                    "restart with a larger --kv-budget"
                )
        promised = self.promised() if self.promised is not None else 0
        if target < min(promised, pool.capacity):  # a grow toward the promise is fine
            raise ResizeRefused(
                f"an admitted request may need {promised:,} pages to finish (its prompt plus "
                f"max_tokens); the new size {target:,} could never hold it; wait for it to finish "
                f"or choose a size of at least {self.round_to_segments(promised):,} pages"
            )
        if target < pool.used_pages:
            pinned = self.pinned() if self.pinned is not None else 0
            held = (
                f", {pinned:,} of them by pinned prefixes (kvctl prefix ls; kvctl prefix unpin)"
                if pinned
                else ""
            )
            raise ResizeRefused(
                f"{pool.used_pages:,} pages in use above the new size {target:,}{held}; "
                "wait for requests to finish or choose a size of at least "
                f"{self.round_to_segments(pool.used_pages):,} pages"
            )
        if target < pool.used_pages + pool.cached_pages and not pool.can_evict:
            raise ResizeRefused(
                f"{pool.used_pages + pool.cached_pages:,} pages are used or cached above the new "
                f"size {target:,} and nothing can evict the cached ones; choose a larger size"
            )
        return target

    def resize(self, pages: int, floor: int | None = None) -> ResizeResult:
        """Grow or shrink to `pages` (rounded up to whole segments; `floor` as in `check`)."""
        target = self.check(pages, floor)
        old = self.pool.capacity
        if target > old:
            self._grow(target - old)
            return ResizeResult(old, target, 0, 0)
        if target < old:
            moved, evicted = self._shrink(target)
            return ResizeResult(old, target, moved, evicted)
        return ResizeResult(old, old, 0, 0)

    def _grow(self, pages: int) -> None:
        if self.storage is not None:
            self.storage.add_segments(pages // self.pool.segment_pages)
        self.pool.sizing.grow(pages)

    def _shrink(self, target: int) -> tuple[int, int]:
        pool = self.pool
        pool.sizing.release_reservations()
        evicted = 0
        overflow = pool.used_pages + pool.cached_pages - target
        if overflow > 0:
            evicted = self._evict(overflow)
        report = self.defragmenter.run(DefragTrigger.SHRINK, boundary=target)
        self.last_evacuation = report
        if not report.complete:
            raise ResizeRefused(
                f"could not evacuate pages above {target}; the pool keeps {pool.capacity} pages"
            )
        released = (pool.capacity - target) // pool.segment_pages
        pool.sizing.truncate(target)
        if self.storage is not None:
            self.storage.release_segments(released)
        return report.pages_moved, evicted

    def _evict(self, pages: int) -> int:
        """Free cached pages so that what is occupied fits the new size."""
        freed = self.pool.evict(pages, "shrink")
        if freed < pages:
            raise ResizeRefused(f"could evict only {freed} of {pages} cached pages")
        return freed
