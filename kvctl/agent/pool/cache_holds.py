"""The prefix cache's holds on pages: what keeps a page alive after its sequences end.

A held page no table references is `cached`; releasing the hold frees it. The pool's request
paths (`fork`, `adopt`, `free`) read the hold marks but never set or clear them: only the prefix
cache (and the window pages) does, when it keeps a prompt's pages and when it evicts them. So
holding and releasing are a part of their own, reached as `pool.holds`, off the per-token paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvctl.agent.pool.errors import PoolError
from kvctl.agent.pool.page_table import as_run, runs_of

if TYPE_CHECKING:
    from kvctl.agent.pool.page_pool import PagePool


class CacheHolds:
    """Marks pages as held by the prefix cache, and drops those marks.

    Works on its pool's page arrays (reference counts, hold marks, owner index) and counts the
    pages held in `held`, used or not. Holding a page makes the tables that hold it neither
    private nor writable in place (their last page would need a copy before a write).
    """

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self.held = 0  # pages the prefix cache holds (used or not)

    def hold(self, pages: Sequence[int]) -> None:
        """Mark in-use pages as also held by the prefix cache, so they outlive their sequences.

        Pages that are one range of ids (the common case: a prompt's run) are marked with a few
        slice operations; others one by one. Refuses, changing nothing, if a page is free.
        """
        pool = self._pool
        ref, cached, owner = pool._ref, pool._cached, pool._owner
        lo = as_run(pages, pool._ids)
        if lo is not None:
            hi = lo + len(pages)
            holder = owner[lo]
            if (  # pages of one live private run (the common case): in use, not yet held
                holder is not None
                and holder.private
                and holder.loose_from < 0
                and len(holder.run_starts) == 1
                and pool._tables.get(holder.seq_id) is holder
                and holder.pages[0] <= lo
                and hi <= holder.pages[0] + len(holder.pages)
            ):
                self.held += hi - lo
                cached[lo:hi] = b"\x01" * (hi - lo)
                holder.private = holder.writable = False
                return
            if 0 not in ref[lo:hi] or 0 not in cached[lo:hi]:  # every page used or held
                self.held += cached[lo:hi].count(0)
                cached[lo:hi] = b"\x01" * (hi - lo)
                owners = owner[lo:hi]
                first = owners[0]
                holders = (first,) if owners.count(first) == len(owners) else set(owners)
                for holder in holders:
                    if holder is not None:  # conservative: False is always safe
                        holder.private = holder.writable = False
                return
        for p in pages:  # refuse before changing anything
            if not ref[p] and not cached[p]:
                raise PoolError(f"page {p} is free; the prefix cache can only hold pages in use")
        for p in pages:
            if cached[p]:
                continue
            self.held += 1
            cached[p] = 1
            if ref[p] == 1:
                holder = owner[p]
                assert holder is not None
                holder.private = holder.writable = False
            # pages two tables hold are not private to either, nor writable in place

    def release(self, pages: Sequence[int]) -> None:
        """Drop the prefix cache's hold; pages no sequence uses become free.

        Refuses, changing nothing, if any page is not held. A range of ids nobody else uses
        (the common case: an evicted prompt's run) is released with a few slice operations.
        """
        pool = self._pool
        cached, ref = pool._cached, pool._ref
        lo = as_run(pages, pool._ids)
        if lo is not None:
            hi = lo + len(pages)
            if 0 in cached[lo:hi]:
                raise PoolError(f"pages from {lo} to {hi - 1} are not all held by the cache")
            cached[lo:hi] = bytes(hi - lo)
            self.held -= hi - lo
            if not any(ref[lo:hi]):
                pool.cached_pages -= hi - lo
                pool._free.give(lo, hi - lo)
                return
            freed = [p for p in range(lo, hi) if not ref[p]]
        else:
            for p in pages:
                if not cached[p]:
                    raise PoolError(f"page {p} is not held by the prefix cache")
            freed = []
            for p in pages:
                cached[p] = 0
                self.held -= 1
                if not ref[p]:
                    freed.append(p)
        pool.cached_pages -= len(freed)
        for start, length in runs_of(sorted(freed)):
            pool._free.give(start, length)
