"""The paged KV pool's bookkeeping: pages, page tables, reference counts, free space.

Levels, from the request down: a *sequence* (one request's KV) owns a *page table*, an ordered
list of page ids, one page per `page_size` tokens; a *page* is a stable integer id into the pool;
the pool is cut into equal *segments* so it can grow and shrink by whole segments. This module only
decides which page holds what; `storage.KVStorage` applies the decisions to tensors.

Page states: a page is `used` while some page table references it (its reference count is the
number of tables), `cached` while only the prefix cache holds it, and `free` otherwise. Shared pages
are read-only: appending into a shared, partly filled last page first copies it (copy-on-write).

The fast paths: decoding grows every running sequence one page at a time, so `append` takes a
page reserved after the sequence's last page (`reservations`), or under pressure a loose page
(`loose_pages`), inline, with no call and no extent touched; `allocate` takes one run inline.

The owner index: for every page one table holds, `_owner` names that table; pages several
tables hold list them in `_sharers`. A move (defragmentation) then rewrites exactly the tables
that hold the moved pages, so its cost follows the pages moved, not the number of sequences.

No torch and no I/O here, so the whole pool can be exercised in microseconds by tests and by the
simulator.

The pool is built from parts, each in its own module, sharing its page arrays (the same lists,
never copies). `page_table` says what one sequence holds; `reservations` and `loose_pages` serve
the fast paths, which use them inline. The others are off the allocation paths, so the pool
lends them to their callers as attributes rather than carrying their methods: `pool.holds`
(`cache_holds`: the prefix cache's holds), `pool.relocation` (`relocation`: moving pages),
`pool.sizing` (`pool_sizing`: growing and truncating), `pool.pages` (`page_view`: page by page
readings), `pool.invariants` (`pool_check`: the leak check). What stays here is what a request
does (allocate, append, fork, adopt, free) and the counters every reading starts from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvctl.agent.pool.cache_holds import CacheHolds
from kvctl.agent.pool.errors import PoolError, PoolExhausted, UnknownSequence
from kvctl.agent.pool.extents import FreeExtents
from kvctl.agent.pool.loose_pages import LoosePages
from kvctl.agent.pool.page_table import CopyOnWrite, PageTable, SeqId, as_run, runs_of
from kvctl.agent.pool.page_view import PageView
from kvctl.agent.pool.pool_check import PoolInvariants
from kvctl.agent.pool.pool_sizing import PoolSizing
from kvctl.agent.pool.relocation import Relocation
from kvctl.agent.pool.reservations import Reservations
from kvctl.agent.pool.stats import PoolOccupancy

__all__ = ["DEFAULT_RESERVE_PAGES", "CopyOnWrite", "PagePool", "PageTable", "SeqId"]

Evictor = Callable[[int, str], int]
"""Frees at least the given number of cached pages if it can; returns how many it freed."""

DEFAULT_RESERVE_PAGES = 128
"""Pages a growing sequence takes at once (one used now, the rest reserved for its next ones)."""


class PagePool:
    """Pages, page tables and the free space of one KV pool.

    Guarantees, checked by `invariants.check()`: free + used + cached == capacity; a page's
    reference count equals the number of page tables that hold it; no table holds a page twice;
    free pages are exactly the pages with no reference and no cache hold, either in the free
    extents or reserved for one sequence's growth.

    Its parts, reached as attributes: `holds` (the prefix cache's holds), `relocation` (moving
    pages), `sizing` (growing, truncating), `pages` (page by page readings), `invariants` (the
    leak check).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        segment_pages: int | None = None,
        bytes_per_page: int = 0,
        reserve_pages: int = DEFAULT_RESERVE_PAGES,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        segment_pages = segment_pages or num_pages
        if segment_pages < 1:
            raise ValueError(f"segment_pages must be at least 1, got {segment_pages}")
        if reserve_pages < 1:
            raise ValueError(f"reserve_pages must be at least 1, got {reserve_pages}")
        self.page_size = page_size
        self.segment_pages = segment_pages
        self.bytes_per_page = bytes_per_page
        self.reserve_pages = reserve_pages  # the most pages a growing sequence takes at once
        capacity = -(-num_pages // segment_pages) * segment_pages
        self.capacity = capacity
        self._ref = [0] * capacity
        # Page tables are cut from this list: slicing shares its int objects, where building
        # `list(range(...))` would allocate one object per page id above 256.
        self._ids = list(range(capacity))
        self._cached = bytearray(capacity)
        self._owner: list[PageTable | None] = [None] * capacity
        self._sharers: dict[int, list[PageTable]] = {}  # page -> its tables, while 2 or more
        self._free = FreeExtents()
        self._free.give(0, capacity)
        self._tables: dict[SeqId, PageTable] = {}
        self._reservations = Reservations(self._free, reserve_pages, capacity)
        self._loose = LoosePages(self._free, self._ids)
        self.cached_pages = 0
        # allocations are counted where pages are claimed from the free runs (`_claims`) and
        # where one fails; the reservations and loose pages count what they hand out, so the
        # fast paths in `append` count nothing (see `alloc_attempts`)
        self._claims = 0
        self.alloc_failures = 0
        self.contiguous_misses = 0
        self._evictor: Evictor | None = None
        self._ones = [[1] * n for n in range(65)]
        self._zeros = [[0] * n for n in range(65)]
        self.holds = CacheHolds(self)
        self.relocation = Relocation(self)
        self.sizing = PoolSizing(self)
        self.pages = PageView(self)
        self.invariants = PoolInvariants(self)

    # ---- wiring -------------------------------------------------------------------------

    def set_evictor(self, evictor: Evictor | None) -> None:
        """Install the function that frees cached pages when an allocation runs short."""
        self._evictor = evictor

    # ---- reading ------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        """Pages holding nothing: in the free runs, loose, or reserved for a sequence's growth."""
        return self._free.free_pages + len(self._loose.pages) + self._reservations.pages

    @property
    def reserved_pages(self) -> int:
        return self._reservations.pages

    @property
    def alloc_attempts(self) -> int:
        """Allocations tried: pages claimed from the free runs, failures, and pages handed out
        by the reservations and the loose pages (which count them, so the fast paths need not)."""
        return (
            self._claims
            + self.alloc_failures
            + self._reservations.handed_out
            + self._loose.handed_out
        )

    @property
    def used_pages(self) -> int:
        """Pages some page table references (free + used + cached == capacity)."""
        return self.capacity - self.free_pages - self.cached_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def table(self, seq_id: SeqId) -> PageTable:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise UnknownSequence(f"sequence {seq_id!r} is not in the pool") from None

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def sequences(self) -> list[SeqId]:
        return list(self._tables)

    def stats(self) -> PoolOccupancy:
        """One reading; loose pages are filed into the free runs first, so the fragmentation
        figures describe the free space as it is."""
        self._loose.settle()
        free = self._free
        reserved = self._reservations.pages
        return PoolOccupancy(
            page_size=self.page_size,
            bytes_per_page=self.bytes_per_page,
            segment_pages=self.segment_pages,
            segments=self.sizing.segments,
            capacity_pages=self.capacity,
            used_pages=self.used_pages,
            cached_pages=self.cached_pages,
            free_pages=free.free_pages + reserved,
            free_extents=len(free),
            largest_free_run=free.largest(),
            sequences=len(self._tables),
            alloc_attempts_total=self.alloc_attempts,
            alloc_failures_total=self.alloc_failures,
            contiguous_misses_total=self.contiguous_misses,
            reserved_pages=reserved,
        )

    # ---- allocation ---------------------------------------------------------------------

    def available_pages(self) -> int:
        """Pages an allocation can get: free ones, plus cached ones if they can be evicted."""
        return self.free_pages + (self.cached_pages if self._evictor else 0)

    def evict(self, num_pages: int, reason: str = "allocation") -> int:
        """Ask the prefix cache to free at least `num_pages` cached pages, because of `reason`
        (what needs the room); return how many."""
        if self._evictor is None or not self.cached_pages:
            return 0
        return self._evictor(num_pages, reason)

    @property
    def can_evict(self) -> bool:
        return self._evictor is not None

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether `allocate` of `num_tokens` would succeed."""
        return self.pages_for(num_tokens) <= self.available_pages()

    def allocate(self, seq_id: SeqId, num_tokens: int) -> PageTable:
        """Create the page table of a new sequence with room for `num_tokens` tokens.

        Prefers one contiguous run of pages and falls back to scattered pages. Raises
        `PoolExhausted` (and counts a failure) when the pages cannot be found even after
        reclaiming reservations and evicting cached pages; the pool is then unchanged.
        """
        tables = self._tables
        if seq_id in tables:
            raise PoolError(f"sequence {seq_id!r} already has a page table")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        n = -(-num_tokens // self.page_size)
        start = self._free.take_run(n) if n else None
        if start is not None:  # the common case, kept short: one run of fresh pages
            self._claims += 1  # `_claim`, written out inline
            self._ref[start : start + n] = self._ones[n] if n <= 64 else [1] * n
            table = PageTable(seq_id, self._ids[start : start + n], num_tokens, n * self.page_size)
            self._owner[start : start + n] = [table] * n
        else:
            table = PageTable(seq_id, [], num_tokens, n * self.page_size)
            if n:
                pages, starts = self._take(n, table, prefer_run=True)
                table.pages = pages
                if starts is None:
                    table.loose_from = 0
                else:
                    table.run_starts = starts
        tables[seq_id] = table
        return table

    def can_append(self, seq_id: SeqId, num_tokens: int = 1) -> bool:
        table = self.table(seq_id)
        return self._pages_to_append(table, num_tokens) <= self.available_pages()

    def append(self, seq_id: SeqId, num_tokens: int = 1) -> list[CopyOnWrite]:
        """Make room for `num_tokens` more tokens in a sequence.

        Returns the copies storage must apply first: when the last page is partly filled and
        shared (or held by the prefix cache), it is replaced by a private copy. Raises
        `PoolExhausted` with nothing changed when the pages cannot be found.
        """
        try:
            table = self._tables[seq_id]
        except KeyError:
            raise UnknownSequence(f"sequence {seq_id!r} is not in the pool") from None
        total = table.num_tokens + num_tokens
        room = table.room
        if total <= room:  # room in the last page
            if num_tokens >= 0 and table.writable:
                table.num_tokens = total
                return []
        elif table.writable and total <= room + self.page_size:  # one more page (so n > 0)
            page = table.reserve_next
            if page < table.reserve_end:
                # the next reserved page: it follows the last one, so the run goes on (the
                # reservations count it as handed out, from their own counters)
                table.reserve_next = page + 1
                reservations = self._reservations
                reservations.pages -= 1
                if page + 1 == table.reserve_end:
                    del reservations.tables[seq_id]
                self._ref[page] = 1
                table.pages.append(page)
                table.room = room + self.page_size
                table.num_tokens = total
                return []
            if table.loose_from >= 0 and (loose := self._loose.pages):
                # under pressure: a loose page, as cheap as a free list's (counted by the
                # loose pages, as handed out, from their own counters)
                page = loose.pop()
                self._ref[page] = 1
                self._owner[page] = table
                table.pages.append(page)
                table.room = room + self.page_size
                table.num_tokens = total
                return []
        return self._append_slow(table, num_tokens)

    def _append_slow(self, table: PageTable, num_tokens: int) -> list[CopyOnWrite]:
        """`append` when it needs a copy, more than one page, or a new reservation."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        needed = self._pages_to_append(table, num_tokens)
        if needed == 0:
            table.num_tokens += num_tokens
            return []
        copies: list[CopyOnWrite] = []
        cow = self._last_page_is_shared(table) if num_tokens else False
        # back to the free runs at once (not the fast lists), where `_take` finds it again
        self._reservations.drop(table, at_once=True)
        if needed == 1 and not cow and table.private and self._grow_one(table) is not None:
            table.num_tokens += num_tokens
            table.writable = True
            return []
        new_pages, new_starts = self._take(needed, table, prefer_run=False, extend=not cow)
        self._add_pages(table, new_pages, new_starts, num_tokens, copies, cow)
        return copies

    def _grow_one(self, table: PageTable) -> int | None:
        """One more page for a private, growing table, the cheap way; None to take the long way.

        A run for a new reservation if one fits (right after the last page first), else a loose
        page (refilling the loose pages from the free runs, or from other reservations).
        """
        free = self._free
        want = self._reservations.size
        pages = table.pages
        if table.loose_from < 0:
            if pages:
                got = free.take_at(pages[-1] + 1, want)
                if got:
                    self._add_pages(table, self._claim(pages[-1] + 1, 1, got, table), [0], 0, [])
                    return pages[-1]
            start = free.take_run(want) if want > 1 and free.free_pages >= want else None
            if start is not None:
                self._add_pages(table, self._claim(start, 1, want, table), [0], 0, [])
                return pages[-1]
        loose = self._loose
        if not loose.pages and not loose.refill():
            self._reservations.reclaim(1)
            if not loose.refill():
                return None
        page = loose.pages.pop()  # counted by the loose pages
        self._ref[page] = 1
        self._owner[page] = table
        if table.loose_from < 0:
            table.loose_from = len(pages)
        pages.append(page)
        table.room += self.page_size
        return page

    def _add_pages(
        self,
        table: PageTable,
        new_pages: list[int],
        new_starts: list[int] | None,
        num_tokens: int,
        copies: list[CopyOnWrite],
        cow: bool = False,
    ) -> None:
        """Append taken pages to a table (replacing a shared last page first when `cow`)."""
        pages = table.pages
        if cow:
            old = pages.pop()
            self._release((old,), table)
            if not pages:
                table.run_starts = (0,)
            copies.append(CopyOnWrite(old, new_pages[0]))
        base = len(pages)
        if new_starts is None:
            if table.loose_from < 0:
                table.loose_from = base
        elif table.loose_from < 0:  # past `loose_from`, every page goes back loose anyway
            starts = list(table.run_starts)
            if base and new_pages[0] != pages[-1] + 1:
                starts.append(base)
            starts.extend(base + i for i in new_starts[1:])
            table.run_starts = starts
        pages.extend(new_pages)
        table.room = (table.dropped + len(pages)) * self.page_size
        table.num_tokens += num_tokens
        table.writable = True  # the last page is a fresh one now

    def fork(self, parent_id: SeqId, child_id: SeqId) -> PageTable:
        """Start `child_id` sharing every page of `parent_id` (reference counted, read-only)."""
        parent = self.table(parent_id)
        if child_id in self._tables:
            raise PoolError(f"sequence {child_id!r} already has a page table")
        child = PageTable(child_id, list(parent.pages), parent.num_tokens, parent.room, True)
        child.dropped = parent.dropped
        self._acquire(parent.pages, child)
        self._tables[child_id] = child
        return child

    def adopt(
        self,
        seq_id: SeqId,
        shared_pages: Sequence[int],
        shared_tokens: int,
        num_tokens: int,
        dropped: int = 0,
    ) -> tuple[PageTable, list[CopyOnWrite]]:
        """Start a sequence whose first `shared_tokens` tokens are in existing pages (prefix hit).

        The shared pages gain a reference; room for the rest of `num_tokens` is made as by
        `append`, so a partly matched last page is copied before the sequence writes into it.
        Returns the table and the copies to apply. Raises `PoolExhausted` with nothing changed
        when the rest does not fit. `dropped`: the shared pages start after that many pages the
        sequence will never read (a sliding window's), which it starts without.
        """
        if seq_id in self._tables:
            raise PoolError(f"sequence {seq_id!r} already has a page table")
        places = dropped + len(shared_pages)
        if self.pages_for(shared_tokens) != places or shared_tokens > num_tokens:
            raise PoolError("adopt: shared pages do not match the shared token count")
        if dropped and not shared_pages:
            raise PoolError("adopt: a sequence cannot start without any page")
        table = PageTable(seq_id, list(shared_pages), shared_tokens, places * self.page_size, True)
        table.dropped = dropped
        self._acquire(shared_pages, table)
        self._tables[seq_id] = table
        try:
            copies = self.append(seq_id, num_tokens - shared_tokens)
        except PoolExhausted:
            del self._tables[seq_id]
            self._release(shared_pages, table)
            raise
        return table, copies

    def free(self, seq_id: SeqId) -> None:
        """Drop a sequence: its pages become free, or cached while the prefix cache holds them."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            raise UnknownSequence(f"sequence {seq_id!r} is not in the pool")
        if table.reserve_end:
            self._reservations.drop(table)
        pages = table.pages
        if not table.private:
            self._release(pages, table)
            return
        ref, give = self._ref, self._free.give
        starts = table.run_starts
        n = len(pages)
        if table.loose_from >= 0:
            n = table.loose_from
            tail = pages[n:]
            for p in tail:
                ref[p] = 0
            self._loose.give_back(tail)
        if len(starts) == 1:
            if n:
                start = pages[0]
                ref[start : start + n] = self._zeros[n] if n <= 64 else [0] * n
                give(start, n)
            return
        for lo, hi in zip(starts, [*starts[1:], n], strict=True):
            if hi > lo:
                length = hi - lo
                start = pages[lo]
                ref[start : start + length] = self._zeros[length] if length <= 64 else [0] * length
                give(start, length)

    def release_front(self, seq_id: SeqId, num_pages: int) -> None:
        """Give back a running sequence's first `num_pages` pages (those a sliding window has
        left): free, or cached while the prefix cache holds them. Its last page stays, so it
        can always grow; asking for more is a PoolError and changes nothing."""
        table = self.table(seq_id)
        if not 0 <= num_pages < len(table.pages):
            raise PoolError(
                f"sequence {seq_id!r} holds {len(table.pages)} pages; cannot give back "
                f"{num_pages} of them and keep its last"
            )
        if not num_pages:
            return
        front = table.pages[:num_pages]
        self._release(front, table)
        del table.pages[:num_pages]
        table.dropped += num_pages
        table.private = False  # its recorded runs no longer start at 0: free page by page
        if table.loose_from >= 0:
            table.loose_from = max(0, table.loose_from - num_pages)

    # ---- internals ----------------------------------------------------------------------

    def _pages_to_append(self, table: PageTable, num_tokens: int) -> int:
        needed = self.pages_for(table.num_tokens + num_tokens) - table.dropped - len(table.pages)
        if num_tokens and self._last_page_is_shared(table):
            needed += 1
        return needed

    def _last_page_is_shared(self, table: PageTable) -> bool:
        """The last page is partly filled and someone else can read it: writing needs a copy."""
        if not table.pages or table.num_tokens % self.page_size == 0:
            return False
        last = table.pages[-1]
        return self._ref[last] > 1 or bool(self._cached[last])

    def _take(
        self, n: int, table: PageTable, prefer_run: bool, extend: bool = False
    ) -> tuple[list[int], list[int] | None]:
        """Take `n` free pages for `table`, one reference each (counted as one allocation).

        Makes room first when short (`_make_room`). A growing sequence (`extend`) first tries
        the run right after its last page and reserves a few more pages from the run it takes.
        Otherwise prefers one run. Returns the pages and the indexes where a run of consecutive
        ids begins; when no run fits, loose pages and None (the free space is in shreds: taking
        and returning them one by one is then cheaper than splitting and merging runs, and the
        smallest runs are spent first, so large ones stay whole).
        """
        if n > self._free.free_pages + len(self._loose.pages):
            self._make_room(n)
        if extend:
            claimed = self._take_extending(n, table)
            if claimed is not None:
                return claimed, [0]
        else:
            start = self._free.take_run(n)
            if start is not None:
                return self._claim(start, n, n, table), [0]
            if prefer_run:
                self.contiguous_misses += 1
        taken = self._loose.take(n)  # counted by the loose pages
        ref, owner = self._ref, self._owner
        for p in taken:
            ref[p] = 1
            owner[p] = table
        return taken, None

    def _make_room(self, n: int) -> None:
        """Reclaim reservations, then evict cached pages, until the free runs and the loose pages
        hold `n` pages; else count a failed allocation and raise `PoolExhausted`."""
        free, loose = self._free, self._loose.pages
        if n <= self.available_pages():
            self._reservations.reclaim(n - len(loose))
            if n > free.free_pages + len(loose):
                self.evict(n - free.free_pages - len(loose))
        if n > free.free_pages + len(loose):
            self.alloc_failures += 1
            raise PoolExhausted(
                f"need {n} pages, {self.free_pages} free and {self.cached_pages} "
                f"cached of {self.capacity}; grow the pool or wait for requests to finish"
            )

    def _take_extending(self, n: int, table: PageTable) -> list[int] | None:
        """`n` pages for a growing table out of one run, plus a reservation from the same run:
        the run right after its last page if it has `n` pages, else any run that fits (or the
        largest, if it holds `n`); None when no run holds `n` pages."""
        free = self._free
        want = n + self._reservations.size - 1
        pages = table.pages
        if pages:
            got = free.take_at(pages[-1] + 1, want)
            if got >= n:
                return self._claim(pages[-1] + 1, n, got, table)
            if got:
                free.give_now(pages[-1] + 1, got)
        taken = free.take_up_to(want, n)
        if taken is None:
            return None
        return self._claim(taken[0], n, taken[1], table)

    def _claim(self, start: int, n: int, got: int, table: PageTable) -> list[int]:
        """Give `table` the first `n` of `got` pages taken from `start` (one allocation); reserve
        the rest for its growth."""
        self._claims += 1
        self._ref[start : start + n] = self._ones[n] if n <= 64 else [1] * n
        self._owner[start : start + got] = [table] * got
        if got > n:
            self._reservations.add(table, start + n, got - n)
        return self._ids[start : start + n]

    def _acquire(self, pages: Sequence[int], table: PageTable) -> None:
        """Add `table` as a holder of each page (fork, prefix hit).

        A prefix hit on a run of pages only the cache holds (the common case) takes a few slice
        operations; anything else goes page by page.
        """
        ref, cached, owner, sharers = self._ref, self._cached, self._owner, self._sharers
        lo = as_run(pages, self._ids)
        if lo is not None:
            hi = lo + len(pages)
            if not any(ref[lo:hi]) and 0 not in cached[lo:hi]:
                ref[lo:hi] = self._ones[hi - lo] if hi - lo <= 64 else [1] * (hi - lo)
                owner[lo:hi] = [table] * (hi - lo)
                self.cached_pages -= hi - lo
                return
        for p in pages:
            r = ref[p]
            if r == 0:
                if not cached[p]:
                    raise PoolError(f"page {p} is free and cannot be shared")
                self.cached_pages -= 1
                owner[p] = table
            elif r == 1:
                holder = owner[p]
                assert holder is not None
                holder.private = holder.writable = False
                sharers[p] = [holder, table]
            else:
                sharers[p].append(table)
            ref[p] = r + 1

    def _release(self, pages: Sequence[int], table: PageTable) -> None:
        """Drop `table`'s reference to each page; return pages nobody holds to the free space.

        Runs of pages only this table holds are released with slice operations (a sequence
        that started on a cached prefix frees it this way); the rest page by page.
        """
        ref, cached = self._ref, self._cached
        lo = as_run(pages, self._ids)
        runs = [(lo, len(pages))] if lo is not None else runs_of(pages)
        for start, length in runs:
            hi = start + length
            if length >= 4 and ref[start:hi].count(1) == length:
                ref[start:hi] = self._zeros[length] if length <= 64 else [0] * length
                held = cached[start:hi].count(1)
                if held == length:
                    self.cached_pages += length
                    continue
                if held == 0:
                    self._free.give(start, length)
                    continue
            self._release_pages(range(start, hi), table)

    def _release_pages(self, pages: Iterable[int], table: PageTable) -> None:
        """`_release`, one page at a time (pages whose references were not yet dropped are
        dropped here; a run already zeroed by `_release` is told apart by its reference)."""
        ref, cached, sharers = self._ref, self._cached, self._sharers
        run_start, run_len = -1, 0
        give = self._free.give
        for p in pages:
            r = ref[p]
            if r:
                r -= 1
                ref[p] = r
                if r:
                    holders = sharers[p]
                    holders.remove(table)
                    if r == 1:
                        self._owner[p] = holders[0]
                        del sharers[p]
                    continue
            if cached[p]:
                self.cached_pages += 1
            elif p == run_start + run_len:
                run_len += 1
            else:
                if run_len:
                    give(run_start, run_len)
                run_start, run_len = p, 1
        if run_len:
            give(run_start, run_len)
