"""The pool's leak check: every piece of its bookkeeping, recounted from the page tables.

A part of the pool, reached as `pool.invariants`: tests, the simulator and the benchmarks run it
after operations, the serving paths never, so it lives apart from the pool's own code and grows
one small method per piece without weighing on it. Every disagreement raises `PoolCorrupted`,
never a bare `assert`, which `python -O` removes.
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING

from kvctl.agent.pool.errors import PoolCorrupted
from kvctl.agent.pool.page_table import PageTable

if TYPE_CHECKING:
    from kvctl.agent.pool.page_pool import PagePool


class PoolInvariants:
    """Recounts its pool's bookkeeping from the page tables and compares; changes nothing."""

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool

    def check(self) -> None:
        """Raise `PoolCorrupted` if any bookkeeping of the pool disagrees with any other.

        Free + used + cached == capacity; reference counts equal table references; the owner
        index and the sharers agree with the tables; reserved and loose pages are free and held
        by nobody; free pages are exactly the unreferenced, unheld ones.
        """
        reserved = self._loose_marks()
        counts, holders = self._count_references(reserved)
        self._check_owners(counts, holders)
        self._check_reservations(reserved)
        free = self._free_marks()
        self._check_page_states(counts, reserved, free)
        self._check_totals(counts)

    def _loose_marks(self) -> bytearray:
        """One mark per loose page (each page loose at most once)."""
        pool = self._pool
        marks = bytearray(pool.capacity)
        for p in pool._loose.pages:
            if marks[p]:
                raise PoolCorrupted(f"page {p} is loose twice")
            marks[p] = 1
        return marks

    def _count_references(
        self, reserved: bytearray
    ) -> tuple[list[int], dict[int, list[PageTable]]]:
        """Check each table; count the tables holding each page, and mark the reserved pages in
        `reserved` (next to the loose ones): a reserved page is held by nobody."""
        pool = self._pool
        counts = [0] * pool.capacity
        holders: dict[int, list[PageTable]] = {}
        for table in pool._tables.values():
            self._check_table(table)
            for p in table.pages:
                if not 0 <= p < pool.capacity:
                    raise PoolCorrupted(f"sequence {table.seq_id!r} holds page {p} beyond the pool")
                counts[p] += 1
                holders.setdefault(p, []).append(table)
            for p in range(table.reserve_next, table.reserve_end):
                if counts[p] or reserved[p] or pool._cached[p]:
                    raise PoolCorrupted(f"reserved page {p} is also held")
                reserved[p] = 1
        return counts, holders

    def _check_owners(self, counts: list[int], holders: dict[int, list[PageTable]]) -> None:
        """Reference counts, the owner index and the sharers agree with the tables."""
        pool = self._pool
        if counts != pool._ref:
            raise PoolCorrupted("reference counts differ from the page tables")
        sharers = pool._sharers
        for p, tables in holders.items():
            if len(tables) == 1 and pool._owner[p] is not tables[0]:
                raise PoolCorrupted(f"page {p}: the owner index names the wrong table")
            if len(tables) > 1 and sorted(map(id, sharers.get(p, []))) != sorted(map(id, tables)):
                raise PoolCorrupted(f"page {p}: the sharers differ from the tables holding it")
        if any(pool._ref[p] < 2 for p in sharers):
            raise PoolCorrupted("a page listed as shared is held by fewer than two tables")

    def _check_reservations(self, reserved: bytearray) -> None:
        """The tables listed as reserving are those with reserved pages, and the count of
        reserved pages is the number of pages they reserve."""
        pool = self._pool
        reservations = pool._reservations
        reserving = {t.seq_id for t in pool._tables.values() if t.reserve_next < t.reserve_end}
        marked = sum(reserved) - len(pool._loose.pages)
        if reserving != set(reservations.tables) or marked != reservations.pages:
            raise PoolCorrupted("the reservations are miscounted")

    def _free_marks(self) -> bytearray:
        """One mark per page in the free runs (which neither overlap nor touch)."""
        pool = self._pool
        marks = bytearray(pool.capacity)
        previous_end = -1
        for start, length in pool._free.runs():
            if start <= previous_end:
                raise PoolCorrupted(f"free runs overlap or touch at page {start}")
            previous_end = start + length
            marks[start : start + length] = b"\x01" * length
        if previous_end > pool.capacity:
            raise PoolCorrupted("a free run extends past the capacity")
        return marks

    def _check_page_states(self, counts: list[int], reserved: bytearray, free: bytearray) -> None:
        """Each page is in the free runs exactly when nothing holds it (no table, no cache
        hold, no reservation, not loose)."""
        pool = self._pool
        cached = pool._cached
        for p in range(pool.capacity):
            held = counts[p] or cached[p] or reserved[p]
            if bool(free[p]) == bool(held):
                raise PoolCorrupted(f"page {p} is free and held, or neither")

    def _check_totals(self, counts: list[int]) -> None:
        """The pool's counters: cache holds, cached pages, and free + used + cached ==
        capacity."""
        pool = self._pool
        if pool.holds.held != sum(pool._cached):
            raise PoolCorrupted("the count of cache-held pages is wrong")
        used = sum(1 for c in counts if c)
        cached = sum(1 for p in range(pool.capacity) if pool._cached[p] and not counts[p])
        if cached != pool.cached_pages:
            raise PoolCorrupted(f"{pool.cached_pages} pages counted as cached, {cached} are")
        if pool.free_pages + used + cached != pool.capacity:
            raise PoolCorrupted("free + used + cached != capacity")

    def _check_table(self, table: PageTable) -> None:
        """One table agrees with itself and with the pool: its pages, room, flags and runs."""
        pool = self._pool
        name = f"sequence {table.seq_id!r}"
        pages = table.pages
        if len(set(pages)) != len(pages):
            raise PoolCorrupted(f"{name} holds a page twice")
        if table.dropped + len(pages) != pool.pages_for(table.num_tokens):
            raise PoolCorrupted(f"{name}: pages do not match its tokens")
        if table.dropped and not pages:
            raise PoolCorrupted(f"{name} gave back every page")
        if table.room != (table.dropped + len(pages)) * pool.page_size:
            raise PoolCorrupted(f"{name}: its room is miscounted")
        self._check_table_flags(table, name)
        if table.reserve_next < table.reserve_end and (
            not pages or table.reserve_next != pages[-1] + 1
        ):
            raise PoolCorrupted(f"{name}: its reservation does not follow its last page")

    def _check_table_flags(self, table: PageTable, name: str) -> None:
        """`writable` and `private` hold only when true (False is always safe), and a private
        table's recorded runs are its runs."""
        pages = table.pages
        ref, cached = self._pool._ref, self._pool._cached
        if pages and table.writable and (ref[pages[-1]] != 1 or cached[pages[-1]]):
            raise PoolCorrupted(f"{name} is marked writable but its last page is shared")
        if not (table.private and pages):
            return
        if not all(ref[p] == 1 and not cached[p] for p in pages):
            raise PoolCorrupted(f"{name} is marked private but shares a page")
        check_runs(table, name)


def check_runs(table: PageTable, name: str) -> None:
    """The run starts of a private table are ordered, and each recorded run is contiguous (the
    pages from `loose_from` on are loose, in no order). A table's own check: no pool needed."""
    pages = table.pages
    end = len(pages) if table.loose_from < 0 else table.loose_from
    bounds = [*table.run_starts, end]
    ordered = all(a < b for a, b in pairwise(bounds))
    if end and (bounds[0] != 0 or not ordered):
        raise PoolCorrupted(f"{name}: its run starts are out of order")
    for lo, hi in pairwise(bounds):
        if pages[lo:hi] != list(range(pages[lo], pages[lo] + hi - lo)):
            raise PoolCorrupted(f"{name}: a recorded run is not contiguous")
