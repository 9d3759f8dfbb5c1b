"""Growth reservations: free pages set aside, right after a sequence's last page, for its growth.

Decoding grows every running sequence one page at a time. A sequence that needs a page takes a
short run of free pages, uses the first and keeps the rest reserved here: its next pages are then
a counter bump (`PagePool.append` takes them inline, without a call), and they follow its last
page, so the sequence stays one contiguous run (cheap to free, cheap to read). Reserved pages
hold nothing: they count as free, and whoever needs them gets them back at once: an allocation
that finds too few free pages reclaims reservations before it evicts cached pages or fails
(`reclaim`), the defragmenter releases those in its way (`drop`), a shrink releases all
(`release_all`).
"""

from __future__ import annotations

from kvctl.agent.pool.extents import FreeExtents
from kvctl.agent.pool.page_table import PageTable, SeqId

RESERVE_SHARE = 8
"""A reservation is at most 1/8 of the pool, so tiny pools keep their pages in plain view."""


class Reservations:
    """The tables holding reserved pages, and how many pages are reserved in all.

    A table's reserved pages are `[reserve_next, reserve_end)`, out of the free extents. The
    pool's fast path takes the next one by bumping `reserve_next`, decrementing `pages` and
    removing the table from `tables` when it has none left; nothing else counts that, so
    `handed_out` derives it from what was reserved and what was given back.
    """

    __slots__ = ("_free", "_granted", "_returned", "limit", "pages", "size", "tables")

    def __init__(self, free: FreeExtents, limit: int, capacity: int) -> None:
        self._free = free
        self.limit = limit  # the most pages one reservation takes at once
        self.tables: dict[SeqId, PageTable] = {}  # tables with reserved pages, oldest first
        self.pages = 0  # reserved pages, all tables together
        self._granted = 0  # pages ever reserved
        self._returned = 0  # pages ever given back unused
        self.size = 1
        self.fit(capacity)

    def fit(self, capacity: int) -> None:
        """Size reservations for a pool of `capacity` pages (at most 1/`RESERVE_SHARE` of it)."""
        self.size = max(1, min(self.limit, capacity // RESERVE_SHARE))

    @property
    def handed_out(self) -> int:
        """Reserved pages that went to their sequence, one allocation each."""
        return self._granted - self._returned - self.pages

    def add(self, table: PageTable, page: int, length: int) -> None:
        """Keep `[page, page + length)`, already out of the free extents, for `table`'s growth."""
        table.reserve_next, table.reserve_end = page, page + length
        self.pages += length
        self._granted += length
        self.tables[table.seq_id] = table

    def drop(self, table: PageTable, at_once: bool = False) -> None:
        """Give a table's unused reserved pages back to the free extents; `at_once` merges them
        into the free runs now instead of the fast lists (so a `take_at` finds them again)."""
        lo, hi = table.reserve_next, table.reserve_end
        if lo < hi:
            self.tables.pop(table.seq_id, None)
            table.reserve_next = table.reserve_end = 0
            self.pages -= hi - lo
            self._returned += hi - lo
            (self._free.give_now if at_once else self._free.give)(lo, hi - lo)

    def release_all(self) -> int:
        """Give every reservation back (before a shrink); return how many pages that was."""
        released = self.pages
        tables = self.tables
        while tables:
            self.drop(tables.popitem()[1])
        return released

    def reclaim(self, pages: int) -> None:
        """Give reservations back, newest first, until the free extents hold `pages` pages."""
        free = self._free
        tables = self.tables
        while free.free_pages < pages and tables:
            self.drop(tables.popitem()[1])
