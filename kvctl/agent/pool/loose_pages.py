"""Loose pages: free pages outside the free runs, handed out one at a time.

When the free space is in shreds, splitting and merging runs for every page costs more than a
free list would. The pool then moves whole small runs (the smallest first, so large runs stay
whole) onto a stack and hands pages out from it one by one, inline on `PagePool.append`'s fast
path; a table returns them here when it ends. A read of the free space (`settle`) files them back
into the free runs, so the fragmentation figures describe the free space as it is.
"""

from __future__ import annotations

from kvctl.agent.pool.errors import PoolCorrupted
from kvctl.agent.pool.extents import FreeExtents
from kvctl.agent.pool.page_table import runs_of

REFILL_PAGES = 64
"""Pages moved at once from the free runs to the loose pages when these run out."""


class LoosePages:
    """A stack of free page ids, out of the free extents, counted as free.

    The pool pops single pages off `pages` directly; nothing else counts those, so
    `handed_out` derives them from what went onto the stack and what left it otherwise.
    """

    __slots__ = ("_free", "_ids", "_in", "_out", "_takes", "pages")

    def __init__(self, free: FreeExtents, ids: list[int]) -> None:
        self._free = free
        self._ids = ids  # the pool's page ids, whose int objects page tables share
        self.pages: list[int] = []
        self._in = 0  # pages ever put on the stack
        self._out = 0  # pages ever taken off it other than one by one
        self._takes = 0  # calls of `take`

    def __len__(self) -> int:
        return len(self.pages)

    @property
    def handed_out(self) -> int:
        """Allocations served: each page popped alone, and each `take`."""
        return self._in - self._out - len(self.pages) + self._takes

    def refill(self) -> bool:
        """Move up to `REFILL_PAGES` pages of the smallest free run onto the stack (lowest id
        on top); False when nothing is free."""
        shred = self._free.take_smallest(REFILL_PAGES)
        if shred is None:
            return False
        start, got = shred
        self.pages.extend(self._ids[start + got - 1 : start - 1 if start else None : -1])
        self._in += got
        return True

    def take(self, n: int) -> list[int]:
        """Take `n` pages, refilling first; the caller has checked that the free extents and
        the stack hold `n` pages together."""
        pages = self.pages
        while len(pages) < n:
            if not self.refill():
                raise PoolCorrupted("free pages are miscounted")
        taken = pages[-n:]
        del pages[-n:]
        self._out += n
        self._takes += 1
        return taken

    def give_back(self, pages: list[int]) -> None:
        """Put pages a table took loose back on the stack."""
        self.pages.extend(pages)
        self._in += len(pages)

    def settle(self) -> None:
        """File the loose pages into the free runs (sorted, as runs)."""
        pages = self.pages
        if pages:
            pages.sort()
            give = self._free.give_now
            for start, length in runs_of(pages):
                give(start, length)
            self._out += len(pages)
            pages.clear()
