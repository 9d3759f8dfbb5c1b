"""Moving pages (defragmentation, shrinks): finding what to move, and switching references.

A part of the pool, reached as `pool.relocation`: the defragmenter (and through it a shrink) is
its only caller, and nothing on the allocation paths moves a page, so moving lives apart from
them. A move rewrites exactly the tables that hold the moved pages (the owner index and the
sharers name them), so its cost follows the pages moved, not the number of sequences. Whoever
holds page ids outside the page tables (the prefix cache) listens for the moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvctl.agent.pool.errors import PoolCorrupted, PoolError
from kvctl.agent.pool.page_table import PageTable, run_starts_of, runs_of

if TYPE_CHECKING:
    from kvctl.agent.pool.page_pool import PagePool

RelocationListener = Callable[[dict[int, int]], None]
"""Told `{old page: new page}` after pages moved, so holders outside page tables can follow."""


class Relocation:
    """Finds the pages to move (the highest occupied, the lowest free) and moves them.

    Works on its pool's page arrays, owner index and free extents; the contents are the
    caller's to copy first (`KVStorage.copy_pages`).
    """

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self._listeners: list[RelocationListener] = []

    def add_listener(self, listener: RelocationListener) -> None:
        """Be told of every page move (the prefix cache follows its pages this way)."""
        self._listeners.append(listener)

    def highest_occupied(self, below: int) -> int:
        """The highest used or cached page under `below`, or -1 if there is none.

        Walks down from `below - 1`, jumping whole free runs; a reservation met on the way is
        released (its pages hold nothing), so the cost follows what is stepped over.
        """
        pool = self._pool
        free = pool._free
        pool._loose.settle()
        free.settle()
        ref, cached, owner = pool._ref, pool._cached, pool._owner
        p = below - 1
        while p >= 0:
            if ref[p] or cached[p]:
                return p
            start = free.run_ending_at(p + 1)
            if start is not None:
                p = start - 1
                continue
            holder = owner[p]
            if holder is None or not holder.reserve_next <= p < holder.reserve_end:
                raise PoolCorrupted(f"page {p} is neither occupied, free nor reserved")
            p = holder.reserve_next - 1  # its pages are free now, like everything above them
            pool._reservations.drop(holder)
        return -1

    def lowest_free_runs(self) -> Iterator[tuple[int, int]]:
        """Free extents lowest first, lazily (see `FreeExtents.lowest_runs`)."""
        self._pool._loose.settle()
        return self._pool._free.lowest_runs()

    def relocate(self, moves: Sequence[tuple[int, int]]) -> None:
        """Switch every reference from each `src` page to its `dst` page, then free the `src`.

        The caller has already copied the contents (`KVStorage.copy_pages`). Each `dst` must be
        in the free extents and each `src` occupied. Only the tables holding a moved page are
        touched (the owner index names them).
        """
        free = self._pool._free
        mapping = dict(moves)
        for start, length in self._check_moves(moves, mapping):
            free.take_range(start, length)
        self._follow_moves(self._move_references(moves), mapping)
        for start, length in runs_of(sorted(mapping)):
            free.give(start, length)
        for listener in self._listeners:
            listener(mapping)

    def _check_moves(
        self, moves: Sequence[tuple[int, int]], mapping: dict[int, int]
    ) -> list[tuple[int, int]]:
        """Refuse moves that repeat a page, start from a free page or land on an occupied one,
        before anything changes; return the destinations as runs."""
        if len(mapping) != len(moves) or len(set(mapping.values())) != len(moves):
            raise PoolError("relocate: a page appears twice in the moves")
        pool = self._pool
        ref, cached = pool._ref, pool._cached
        for src, dst in moves:
            if not (ref[src] or cached[src]):
                raise PoolError(f"relocate: source page {src} is free")
            if ref[dst] or cached[dst] or dst in mapping:
                raise PoolError(f"relocate: destination page {dst} is not free")
        dst_runs = list(runs_of(sorted(mapping.values())))
        for start, length in dst_runs:
            if not pool._free.covers(start, length):
                raise PoolError(f"relocate: destination pages from {start} are not free")
        return dst_runs

    def _move_references(self, moves: Sequence[tuple[int, int]]) -> list[PageTable]:
        """Move each page's reference count, cache hold, owner and sharers to its destination;
        return the tables that hold a moved page (each once)."""
        pool = self._pool
        ref, cached, owner, sharers = pool._ref, pool._cached, pool._owner, pool._sharers
        touched: dict[int, PageTable] = {}
        for src, dst in moves:
            r = ref[src]
            ref[dst], ref[src] = r, 0
            cached[dst], cached[src] = cached[src], 0
            if r == 1:
                holder = owner[src]
                assert holder is not None
                owner[dst] = holder
                touched[id(holder)] = holder
            elif r:
                holders = sharers.pop(src)
                sharers[dst] = holders
                for holder in holders:
                    touched[id(holder)] = holder
        return list(touched.values())

    def _follow_moves(self, tables: Iterable[PageTable], mapping: dict[int, int]) -> None:
        """Rewrite the tables' pages; a table whose last page moved loses its reservation (it
        no longer follows)."""
        reservations = self._pool._reservations
        for table in tables:
            last = table.pages[-1]
            table.pages[:] = [mapping.get(p, p) for p in table.pages]
            if table.private:
                table.run_starts = run_starts_of(table.pages)
                table.loose_from = -1
            if table.pages[-1] != last:
                reservations.drop(table)
