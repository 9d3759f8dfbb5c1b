"""The paged KV pool's bookkeeping: pages, page tables, reference counts, free space.

Levels, from the request down: a *sequence* (one request's KV) owns a *page table*, an ordered
list of page ids, one page per `page_size` tokens; a *page* is a stable integer id into the pool;
the pool is cut into equal *segments* so it can grow and shrink by whole segments. This module only
decides which page holds what; `storage.KVStorage` applies the decisions to tensors.

Page states: a page is `used` while some page table references it (its reference count is the
number of tables), `cached` while only the prefix cache holds it, and `free` otherwise. Shared pages
are read-only: appending into a shared, partly filled last page first copies it (copy-on-write).

No torch and no I/O here, so the whole pool can be exercised in microseconds by tests and by the
simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

from kvctl.agent.pool.errors import PoolError, PoolExhausted, UnknownSequence
from kvctl.agent.pool.extents import FreeExtents
from kvctl.agent.pool.stats import PageRun, PageState, PageStates, PoolStats

SeqId = Hashable
Evictor = Callable[[int], int]
"""Frees at least the given number of cached pages if it can; returns how many it freed."""
RelocationListener = Callable[[dict[int, int]], None]
"""Told `{old page: new page}` after pages moved, so holders outside page tables can follow."""


class PoolCorrupted(PoolError, AssertionError):
    """An invariant of the pool does not hold: a bug, never a user error."""


@dataclass(slots=True)
class PageTable:
    """The pages of one sequence, in token order, and how many tokens they hold.

    `is_run` records that the pages are one ascending run of consecutive ids that no other table
    was given by `fork`, which lets `free` return them to the free space as one extent instead of
    page by page (pages the prefix cache holds are checked separately).
    """

    seq_id: SeqId
    pages: list[int]
    num_tokens: int
    is_run: bool


@dataclass(frozen=True)
class CopyOnWrite:
    """Storage must copy page `src` to `dst` before the sequence writes into `dst`."""

    src: int
    dst: int


def _runs_of(pages: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Split page ids into maximal ascending runs of consecutive ids."""
    start = -1
    length = 0
    for p in pages:
        if p == start + length:
            length += 1
        else:
            if length:
                yield start, length
            start, length = p, 1
    if length:
        yield start, length


class PagePool:
    """Pages, page tables and the free space of one KV pool.

    Guarantees, checked by `check_invariants`: free + used + cached == capacity; a page's reference
    count equals the number of page tables that hold it; no table holds a page twice; free pages
    are exactly the pages with no reference and no cache hold.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        segment_pages: int | None = None,
        bytes_per_page: int = 0,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        segment_pages = segment_pages or num_pages
        if segment_pages < 1:
            raise ValueError(f"segment_pages must be at least 1, got {segment_pages}")
        self.page_size = page_size
        self.segment_pages = segment_pages
        self.bytes_per_page = bytes_per_page
        capacity = -(-num_pages // segment_pages) * segment_pages
        self.capacity = capacity
        self._ref = [0] * capacity
        # Page tables are cut from this list: slicing shares its int objects, where building
        # `list(range(...))` would allocate one object per page id above 256.
        self._ids = list(range(capacity))
        self._cached = bytearray(capacity)
        self._free = FreeExtents()
        self._free.give(0, capacity)
        self._tables: dict[SeqId, PageTable] = {}
        self.cached_pages = 0
        self.alloc_attempts = 0
        self.alloc_failures = 0
        self.contiguous_misses = 0
        self._evictor: Evictor | None = None
        self._listeners: list[RelocationListener] = []
        self._held = 0  # pages the prefix cache holds (used or not)
        self._ones = [[1] * n for n in range(65)]
        self._zeros = [[0] * n for n in range(65)]

    # ---- wiring -------------------------------------------------------------------------

    def set_evictor(self, evictor: Evictor | None) -> None:
        """Install the function that frees cached pages when an allocation runs short."""
        self._evictor = evictor

    def add_relocation_listener(self, listener: RelocationListener) -> None:
        """Be told of every page move (the prefix cache follows its pages this way)."""
        self._listeners.append(listener)

    # ---- reading ------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return self._free.free_pages

    @property
    def used_pages(self) -> int:
        """Pages some page table references (free + used + cached == capacity)."""
        return self.capacity - self._free.free_pages - self.cached_pages

    @property
    def segments(self) -> int:
        return self.capacity // self.segment_pages

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

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def state(self, page: int) -> PageState:
        if self._ref[page]:
            return PageState.USED
        if self._cached[page]:
            return PageState.CACHED
        return PageState.FREE

    def free_runs(self) -> list[tuple[int, int]]:
        """Free extents as (start, length), in increasing page order."""
        return list(self._free.runs())

    def stats(self) -> PoolStats:
        return PoolStats(
            page_size=self.page_size,
            bytes_per_page=self.bytes_per_page,
            segment_pages=self.segment_pages,
            segments=self.segments,
            capacity_pages=self.capacity,
            used_pages=self.used_pages,
            cached_pages=self.cached_pages,
            free_pages=self._free.free_pages,
            free_extents=len(self._free),
            largest_free_run=self._free.largest(),
            sequences=len(self._tables),
            alloc_attempts=self.alloc_attempts,
            alloc_failures=self.alloc_failures,
            contiguous_misses=self.contiguous_misses,
        )

    def page_map(self) -> list[PageRun]:
        """Every page's state, run-length encoded, in page order."""
        return self.page_states().runs()

    def page_states(self) -> PageStates:
        """A copy of every page's state, cheap to take (see `PageStates`)."""
        return PageStates(self.capacity, self.segment_pages, self._ref.copy(), bytes(self._cached))

    # ---- allocation ---------------------------------------------------------------------

    def available_pages(self) -> int:
        """Pages an allocation can get: free ones, plus cached ones if they can be evicted."""
        return self._free.free_pages + (self.cached_pages if self._evictor else 0)

    def evict(self, num_pages: int) -> int:
        """Ask the prefix cache to free at least `num_pages` cached pages; return how many."""
        if self._evictor is None or not self.cached_pages:
            return 0
        return self._evictor(num_pages)

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
        evicting cached pages; the pool is then unchanged.
        """
        tables = self._tables
        if seq_id in tables:
            raise PoolError(f"sequence {seq_id!r} already has a page table")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        n = -(-num_tokens // self.page_size)
        start = self._take_run(n) if n else None
        if start is not None:  # the common case, kept short: one run of fresh pages
            table = PageTable(seq_id, self._ids[start : start + n], num_tokens, True)
        else:
            pages, is_run = self._take(n, prefer_run=True) if n else ([], True)
            table = PageTable(seq_id, pages, num_tokens, is_run)
        tables[seq_id] = table
        return table

    def can_append(self, seq_id: SeqId, num_tokens: int = 1) -> bool:
        return self._pages_to_append(self.table(seq_id), num_tokens) <= self.available_pages()

    def append(self, seq_id: SeqId, num_tokens: int = 1) -> list[CopyOnWrite]:
        """Make room for `num_tokens` more tokens in a sequence.

        Returns the copies storage must apply first: when the last page is partly filled and
        shared (or held by the prefix cache), it is replaced by a private copy. Raises
        `PoolExhausted` with nothing changed when the pages cannot be found.
        """
        table = self.table(seq_id)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        needed = self._pages_to_append(table, num_tokens)
        if needed == 0:
            table.num_tokens += num_tokens
            return []
        new_pages, new_is_run = self._take(needed, prefer_run=False)
        copies: list[CopyOnWrite] = []
        if self._last_page_is_shared(table):
            old = table.pages[-1]
            new = new_pages.pop(0)
            table.pages[-1] = new
            self._release([old])
            copies.append(CopyOnWrite(old, new))
            table.is_run = len(table.pages) == 1
            new_is_run = _is_run(new_pages)
        if new_pages:
            follows = not table.pages or new_pages[0] == table.pages[-1] + 1
            table.is_run = table.is_run and new_is_run and follows
            table.pages.extend(new_pages)
        table.num_tokens += num_tokens
        return copies

    def fork(self, parent_id: SeqId, child_id: SeqId) -> PageTable:
        """Start `child_id` sharing every page of `parent_id` (reference counted, read-only)."""
        parent = self.table(parent_id)
        if child_id in self._tables:
            raise PoolError(f"sequence {child_id!r} already has a page table")
        self._acquire(parent.pages)
        parent.is_run = False
        child = PageTable(child_id, list(parent.pages), parent.num_tokens, False)
        self._tables[child_id] = child
        return child

    def adopt(
        self, seq_id: SeqId, shared_pages: Sequence[int], shared_tokens: int, num_tokens: int
    ) -> tuple[PageTable, list[CopyOnWrite]]:
        """Start a sequence whose first `shared_tokens` tokens are in existing pages (prefix hit).

        The shared pages gain a reference; room for the rest of `num_tokens` is made as by
        `append`, so a partly matched last page is copied before the sequence writes into it.
        Returns the table and the copies to apply. Raises `PoolExhausted` with nothing changed
        when the rest does not fit.
        """
        if seq_id in self._tables:
            raise PoolError(f"sequence {seq_id!r} already has a page table")
        if self.pages_for(shared_tokens) != len(shared_pages) or shared_tokens > num_tokens:
            raise PoolError("adopt: shared pages do not match the shared token count")
        self._acquire(shared_pages)
        table = PageTable(seq_id, list(shared_pages), shared_tokens, len(shared_pages) <= 1)
        self._tables[seq_id] = table
        try:
            copies = self.append(seq_id, num_tokens - shared_tokens)
        except PoolExhausted:
            del self._tables[seq_id]
            self._release(shared_pages)
            raise
        return table, copies

    def free(self, seq_id: SeqId) -> None:
        """Drop a sequence: its pages become free, or cached while the prefix cache holds them."""
        try:
            table = self._tables.pop(seq_id)
        except KeyError:
            raise UnknownSequence(f"sequence {seq_id!r} is not in the pool") from None
        pages = table.pages
        n = len(pages)
        if (
            table.is_run
            and 0 < n <= 64
            and (not self._held or not any(self._cached[pages[0] : pages[0] + n]))
        ):
            start = pages[0]
            self._ref[start : start + n] = self._zeros[n]
            self._free.give(start, n)
            return
        self._release(pages)

    # ---- prefix-cache holds -------------------------------------------------------------

    def hold_cached(self, pages: Sequence[int]) -> None:
        """Mark in-use pages as also held by the prefix cache, so they outlive their sequences."""
        for p in pages:
            if not self._ref[p] and not self._cached[p]:
                raise PoolError(f"page {p} is free; the prefix cache can only hold pages in use")
            if not self._cached[p]:
                self._held += 1
            self._cached[p] = 1

    def release_cached(self, pages: Sequence[int]) -> None:
        """Drop the prefix cache's hold; pages no sequence uses become free."""
        freed = []
        for p in pages:
            if not self._cached[p]:
                raise PoolError(f"page {p} is not held by the prefix cache")
            self._cached[p] = 0
            self._held -= 1
            if not self._ref[p]:
                self.cached_pages -= 1
                freed.append(p)
        for start, length in _runs_of(sorted(freed)):
            self._free.give(start, length)

    # ---- moving pages (defragmentation) -------------------------------------------------

    def relocate(self, moves: Sequence[tuple[int, int]]) -> None:
        """Switch every reference from each `src` page to its `dst` page, then free the `src`.

        The caller has already copied the contents (`KVStorage.copy_pages`). Each `dst` must be
        free and each `src` occupied; best applied in ascending `dst` order within a free run,
        which makes each reservation O(1).
        """
        mapping = dict(moves)
        if len(mapping) != len(moves) or len(set(mapping.values())) != len(moves):
            raise PoolError("relocate: a page appears twice in the moves")
        ref, cached = self._ref, self._cached
        for src, dst in moves:
            if not (ref[src] or cached[src]):
                raise PoolError(f"relocate: source page {src} is free")
            if ref[dst] or cached[dst] or dst in mapping:
                raise PoolError(f"relocate: destination page {dst} is not free")
        for start, length in _runs_of(sorted(mapping.values())):
            self._free.take_range(start, length)
        for src, dst in moves:
            ref[dst], ref[src] = ref[src], 0
            cached[dst], cached[src] = cached[src], 0
        moved = set(mapping)
        for table in self._tables.values():
            if not moved.isdisjoint(table.pages):
                table.pages[:] = [mapping.get(p, p) for p in table.pages]
                table.is_run = table.is_run and _is_run(table.pages)
        for start, length in _runs_of(sorted(mapping)):
            self._free.give(start, length)
        for listener in self._listeners:
            listener(mapping)

    # ---- resizing -----------------------------------------------------------------------

    def grow(self, num_pages: int) -> None:
        """Add `num_pages` free pages at the top of the id space (whole segments)."""
        if num_pages <= 0 or num_pages % self.segment_pages:
            raise PoolError(
                f"grow by whole segments of {self.segment_pages} pages, not {num_pages}"
            )
        old = self.capacity
        self._ref.extend([0] * num_pages)
        self._ids.extend(range(old, old + num_pages))
        self._cached.extend(bytes(num_pages))
        self.capacity = old + num_pages
        self._free.give(old, num_pages)

    def occupied_above(self, boundary: int) -> int:
        """Pages at or above `boundary` that are used or cached (what a shrink must move)."""
        free_above = sum(
            min(length, start + length - boundary)
            for start, length in self._free.runs()
            if start + length > boundary
        )
        return max(0, self.capacity - boundary) - free_above

    def truncate(self, new_capacity: int) -> None:
        """Drop the pages from `new_capacity` up, which must all be free."""
        if new_capacity % self.segment_pages or not 0 < new_capacity <= self.capacity:
            raise PoolError(f"truncate to whole segments of {self.segment_pages} pages")
        if self.occupied_above(new_capacity):
            raise PoolError(f"truncate: pages at or above {new_capacity} are still occupied")
        if new_capacity == self.capacity:
            return
        self._free.take_range(new_capacity, self.capacity - new_capacity)
        del self._ref[new_capacity:]
        del self._ids[new_capacity:]
        del self._cached[new_capacity:]
        self.capacity = new_capacity

    # ---- invariants ---------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise `PoolCorrupted` if any bookkeeping disagrees with any other (a leak check)."""
        counts = [0] * self.capacity
        for table in self._tables.values():
            if len(set(table.pages)) != len(table.pages):
                raise PoolCorrupted(f"sequence {table.seq_id!r} holds a page twice")
            if len(table.pages) != self.pages_for(table.num_tokens):
                raise PoolCorrupted(f"sequence {table.seq_id!r}: pages do not match its tokens")
            if table.is_run and not (
                _is_run(table.pages)
                and all(self._ref[p] == 1 or self._cached[p] for p in table.pages)
            ):
                raise PoolCorrupted(f"sequence {table.seq_id!r} is marked as a private run")
            for p in table.pages:
                if not 0 <= p < self.capacity:
                    raise PoolCorrupted(f"sequence {table.seq_id!r} holds page {p} beyond the pool")
                counts[p] += 1
        if counts != self._ref:
            raise PoolCorrupted("reference counts differ from the page tables")
        free = bytearray(self.capacity)
        previous_end = -1
        for start, length in self._free.runs():
            if start <= previous_end:
                raise PoolCorrupted(f"free runs overlap or touch at page {start}")
            previous_end = start + length
            free[start : start + length] = b"\x01" * length
        if previous_end > self.capacity:
            raise PoolCorrupted("a free run extends past the capacity")
        used = sum(1 for c in counts if c)
        cached = sum(1 for p in range(self.capacity) if self._cached[p] and not counts[p])
        for p in range(self.capacity):
            if bool(free[p]) == bool(counts[p] or self._cached[p]):
                raise PoolCorrupted(f"page {p} is free and held, or neither")
        if self._held != sum(self._cached):
            raise PoolCorrupted("the count of cache-held pages is wrong")
        if cached != self.cached_pages:
            raise PoolCorrupted(f"{self.cached_pages} pages counted as cached, {cached} are")
        if self.free_pages + used + cached != self.capacity:
            raise PoolCorrupted("free + used + cached != capacity")

    # ---- internals ----------------------------------------------------------------------

    def _pages_to_append(self, table: PageTable, num_tokens: int) -> int:
        needed = self.pages_for(table.num_tokens + num_tokens) - len(table.pages)
        if num_tokens and self._last_page_is_shared(table):
            needed += 1
        return needed

    def _last_page_is_shared(self, table: PageTable) -> bool:
        """The last page is partly filled and someone else can read it: writing needs a copy."""
        if not table.pages or table.num_tokens % self.page_size == 0:
            return False
        last = table.pages[-1]
        return self._ref[last] > 1 or bool(self._cached[last])

    def _take_run(self, n: int) -> int | None:
        """Take `n` consecutive free pages with one reference each, if a free run fits.

        Counts an attempt when it succeeds; on None the caller goes on to `_take`, which counts.
        """
        start = self._free.take_run(n)
        if start is not None:
            self.alloc_attempts += 1
            self._ref[start : start + n] = self._ones[n] if n <= 64 else [1] * n
        return start

    def _take(self, n: int, prefer_run: bool) -> tuple[list[int], bool]:
        """Take `n` free pages with one reference each; counts the attempt and any failure.

        Evicts cached pages when short, then prefers one run, then scattered pages. Returns the
        pages and whether they form one ascending run.
        """
        free = self._free
        if n > free.free_pages:
            self.evict(n - free.free_pages)
            if n > free.free_pages:
                self.alloc_attempts += 1
                self.alloc_failures += 1
                raise PoolExhausted(
                    f"need {n} pages, {free.free_pages} free and {self.cached_pages} cached of "
                    f"{self.capacity}; grow the pool or wait for requests to finish"
                )
        start = self._take_run(n)
        if start is not None:
            return self._ids[start : start + n], True
        self.alloc_attempts += 1
        if prefer_run:
            self.contiguous_misses += 1
        pages: list[int] = []
        ref = self._ref
        for run_start, length in free.take_scattered(n):
            ref[run_start : run_start + length] = [1] * length
            pages.extend(self._ids[run_start : run_start + length])
        return pages, False

    def _acquire(self, pages: Sequence[int]) -> None:
        ref, cached = self._ref, self._cached
        for p in pages:
            if ref[p] == 0:
                if not cached[p]:
                    raise PoolError(f"page {p} is free and cannot be shared")
                self.cached_pages -= 1
            ref[p] += 1

    def _release(self, pages: Sequence[int]) -> None:
        """Drop one reference from each page; return the pages nobody holds to the free space."""
        ref, cached = self._ref, self._cached
        run_start, run_len = -1, 0
        give = self._free.give
        for p in pages:
            r = ref[p] - 1
            ref[p] = r
            if r:
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


def _is_run(pages: Sequence[int]) -> bool:
    """Whether `pages` is one ascending run of consecutive ids."""
    return not pages or list(pages) == list(range(pages[0], pages[0] + len(pages)))
