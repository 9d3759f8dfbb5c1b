"""The free space of a pool as extents (runs of consecutive free page ids).

Why extents and not a free list of pages: the pool must hand out *contiguous runs* for a request's
prompt and report fragmentation (largest free run, number of runs) on every scrape. A free list of
single pages answers neither without a scan. Here every free run is one entry, so taking a run,
giving one back and coalescing with both neighbours cost a handful of dict operations, whatever
the pool size.

Runs are kept in size classes (segregated fit): classes 1..63 hold runs of exactly that many
pages, classes from 64 up hold runs whose size has the same bit length. A bit mask of non-empty
classes finds the smallest class that can serve a request with two integer operations, so
allocation is best-fit for runs under 64 pages and good-fit above, in O(1) for the common case.

Coalescing is deferred for runs under 64 pages, as malloc's fast bins do: a freed run first goes
to a short LIFO list of its exact size, and a request of that size takes it back from there
without touching the extent maps (requests repeat sizes: a page, a typical prompt). Anything
else settles the lists first (merging every listed run with its neighbours), so every other
answer (`len`, `largest`, `runs`, a request of another size) sees maximal, coalesced runs.
Each listed run is settled at most once, so the deferred cost is the cost `give` saved.

The defragmenter needs the free runs lowest first, on every tick. Sorting every run each time
made a tick cost O(runs log runs) at any size of move; instead every run start that is filed goes
onto a min-heap, and stale entries (runs since merged, split or taken) are dropped when they reach
the top. So the lowest runs cost O(log runs) each, and the heap is rebuilt when stale entries
outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvctl.agent.pool.errors import PoolCorrupted

_EXACT_CLASSES = 64
_RECENT_LIMIT = 256  # runs held back from coalescing, all sizes together: bounds a settle
_BIAS = _EXACT_CLASSES - 7  # class of a run of n >= 64 pages: _BIAS + n.bit_length()


def size_class(length: int) -> int:
    """The class of a run of `length` pages: exact below 64, by bit length above."""
    if length < _EXACT_CLASSES:
        return length
    return _BIAS + length.bit_length()


class FreeExtents:
    """Free page ids as runs `[start, start + length)`.

    Guarantees: runs never overlap. Runs filed in the maps never touch (two touching runs are
    merged when filed); short runs freed recently wait in the fast lists and are merged by
    `settle`, which every reader calls first, so `len(self)` is the number of maximal free
    extents and `largest()` the largest free run.
    """

    __slots__ = (
        "_by_end",
        "_by_start",
        "_classes",
        "_mask",
        "_recent",
        "_recent_runs",
        "_starts",
        "free_pages",
    )

    def __init__(self) -> None:
        self._by_start: dict[int, int] = {}  # start -> length
        self._by_end: dict[int, int] = {}  # end (exclusive) -> start
        self._classes: list[dict[int, None]] = [{} for _ in range(_EXACT_CLASSES + 64)]
        self._mask = 0  # bit c set <=> class c holds at least one run
        # recently freed runs by exact length, not yet coalesced (see the module docstring)
        self._recent: list[list[int]] = [[] for _ in range(_EXACT_CLASSES)]
        self._recent_runs = 0
        self._starts: list[int] = []  # min-heap of run starts, stale entries included
        self.free_pages = 0  # recent runs included

    def __len__(self) -> int:
        self.settle()
        return len(self._by_start)

    def settle(self) -> None:
        """Coalesce every recently freed run into the extent maps."""
        if not self._recent_runs:
            return
        self._recent_runs = 0
        for length, starts in enumerate(self._recent):
            while starts:
                self.free_pages -= length
                self._merge(starts.pop(), length)

    def _file_start(self, start: int) -> None:
        """Put a new run start on the heap; rebuild it once stale entries outnumber live ones."""
        starts = self._starts
        if len(starts) >= 2 * len(self._by_start) + 64:
            # rebuilt from the filed runs (a sorted list is a valid heap); `start` is not filed
            # yet, so it goes on after
            starts = self._starts = sorted(self._by_start)
        heapq.heappush(starts, start)

    def _insert(self, start: int, length: int) -> None:
        self._file_start(start)
        self._by_start[start] = length
        self._by_end[start + length] = start
        c = size_class(length)
        self._classes[c][start] = None
        self._mask |= 1 << c

    def _remove(self, start: int, length: int) -> None:
        del self._by_start[start]
        del self._by_end[start + length]
        c = size_class(length)
        runs = self._classes[c]
        del runs[start]
        if not runs:
            self._mask &= ~(1 << c)

    def give(self, start: int, length: int) -> None:
        """Return the pages `[start, start + length)` to the free space.

        The caller guarantees the pages are not already free. A short run is listed for reuse
        and coalesced later; a long one is merged with its neighbours at once.
        """
        if length < _EXACT_CLASSES and self._recent_runs < _RECENT_LIMIT:
            self._recent[length].append(start)
            self._recent_runs += 1
            self.free_pages += length
            return
        self._merge(start, length)

    def give_now(self, start: int, length: int) -> None:
        """`give`, merged into the runs at once (so `take_at` can find it)."""
        self._merge(start, length)

    def _merge(self, start: int, length: int) -> None:
        """File a free run, merging it with its neighbours. (Hot path: written out inline.)"""
        self.free_pages += length
        by_start, by_end, classes = self._by_start, self._by_end, self._classes
        left = by_end.pop(start, None)
        if left is not None:
            left_len = start - left
            del by_start[left]
            c = left_len if left_len < _EXACT_CLASSES else _BIAS + left_len.bit_length()
            runs = classes[c]
            del runs[left]
            if not runs:
                self._mask &= ~(1 << c)
            start, length = left, length + left_len
        end = start + length
        right_len = by_start.pop(end, None)
        if right_len is not None:
            del by_end[end + right_len]
            c = right_len if right_len < _EXACT_CLASSES else _BIAS + right_len.bit_length()
            runs = classes[c]
            del runs[end]
            if not runs:
                self._mask &= ~(1 << c)
            length += right_len
        if left is None:
            self._file_start(start)
        by_start[start] = length
        by_end[start + length] = start
        c = length if length < _EXACT_CLASSES else _BIAS + length.bit_length()
        classes[c][start] = None
        self._mask |= 1 << c

    def take_run(self, length: int) -> int | None:
        """Take `length` consecutive free pages and return the first id, or None if no run fits.

        A recently freed run of exactly `length` pages is an exact fit and goes first. Otherwise
        serves from the smallest class that fits, and from the low end of the chosen run, so
        large runs stay whole for large requests.
        """
        if length < _EXACT_CLASSES:
            recent = self._recent[length]
            if recent:
                self._recent_runs -= 1
                self.free_pages -= length
                return recent.pop()
        if self._recent_runs:
            self.settle()
        c = length if length < _EXACT_CLASSES else _BIAS + length.bit_length()
        pending = self._mask >> c
        if pending & 1 and c == length < _EXACT_CLASSES:  # an exact fit: no remainder to file
            runs = self._classes[c]
            start = runs.popitem()[0]
            if not runs:
                self._mask &= ~(1 << c)
            del self._by_start[start]
            del self._by_end[start + c]
            self.free_pages -= c
            return start
        while pending:
            skip = (pending & -pending).bit_length() - 1
            c += skip
            pending >>= skip
            runs = self._classes[c]
            if c < _EXACT_CLASSES:
                return self._split(runs.popitem()[0], c, c, length)
            # newest first: deleted keys leave holes at the front of a dict, which forward
            # iteration would walk through on every call
            for start in reversed(runs):
                run_len = self._by_start[start]
                if run_len >= length:
                    del runs[start]
                    return self._split(start, run_len, c, length)
            c += 1
            pending >>= 1
        return None

    def _split(self, start: int, run_len: int, c: int, length: int) -> int:
        """Take the low `length` pages of the run at `start` (of class `c`, already out of it)."""
        by_start = self._by_start
        runs = self._classes[c]
        del by_start[start]
        rest = run_len - length
        if rest:
            new_start = start + length
            self._file_start(new_start)
            by_start[new_start] = rest
            self._by_end[new_start + rest] = new_start
            rc = rest if rest < _EXACT_CLASSES else _BIAS + rest.bit_length()
            if rc != c:
                if not runs:
                    self._mask &= ~(1 << c)
                self._classes[rc][new_start] = None
                self._mask |= 1 << rc
            else:
                runs[new_start] = None
        else:
            del self._by_end[start + run_len]
            if not runs:
                self._mask &= ~(1 << c)
        self.free_pages -= length
        return start

    def take_at(self, start: int, most: int) -> int:
        """Take up to `most` pages from the low end of the free run that begins at `start`.

        Returns how many were taken: 0 when no filed run begins there. This is how a sequence
        extends its last run in place. Runs still in the fast lists are not looked at: a miss
        only costs contiguity, never correctness.
        """
        run_len = self._by_start.get(start)
        if run_len is None:
            return 0
        c = run_len if run_len < _EXACT_CLASSES else _BIAS + run_len.bit_length()
        del self._classes[c][start]
        taken = min(most, run_len)
        self._split(start, run_len, c, taken)
        return taken

    def take_up_to(self, most: int, least: int) -> tuple[int, int] | None:
        """Take `most` consecutive pages if a run fits, else all of the largest run if it holds
        at least `least`; return (first page, pages taken), or None."""
        start = self.take_run(most)
        if start is not None:
            return start, most
        if not self._mask:
            return None
        c = self._mask.bit_length() - 1
        runs = self._classes[c]
        if c < _EXACT_CLASSES:
            if c < least:
                return None
            start = runs.popitem()[0]
            self._split(start, c, c, c)
            return start, c
        start = max(runs, key=self._by_start.__getitem__)
        run_len = self._by_start[start]
        if run_len < least:
            return None
        del runs[start]
        self._split(start, run_len, c, run_len)
        return start, run_len

    def take_smallest(self, most: int) -> tuple[int, int] | None:
        """Take a small free run (a recently freed one, or one of the smallest class), at most
        `most` pages of it; return (start, length) or None. For spending the shreds first, so
        large runs stay whole."""
        if self._recent_runs:
            for length, starts in enumerate(self._recent):
                if starts and length <= most:
                    self._recent_runs -= 1
                    self.free_pages -= length
                    return starts.pop(), length
        if not self._mask:
            return None
        c = (self._mask & -self._mask).bit_length() - 1
        runs = self._classes[c]
        start = runs.popitem()[0]
        if not runs:
            self._mask &= ~(1 << c)
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        if length > most:
            self._insert(start + most, length - most)
            length = most
        self.free_pages -= length
        return start, length

    def covers(self, start: int, length: int) -> bool:
        """Whether the pages `[start, start + length)` are all in one free run."""
        run_start = self.run_containing(start)
        return run_start is not None and start + length <= run_start + self._by_start[run_start]

    def run_ending_at(self, end: int) -> int | None:
        """The start of the filed free run that ends just before page `end`, or None."""
        return self._by_end.get(end)

    def lowest_runs(self) -> Iterator[tuple[int, int]]:
        """Free runs as (start, length), lowest first, read off the heap of run starts.

        Settles the fast lists first. Lazy: a caller that needs only the first few runs pays
        O(log runs) for each, not a sort of them all. The free space must not change while the
        iterator is in use.
        """
        self.settle()
        starts = self._starts
        by_start = self._by_start
        while starts and starts[0] not in by_start:
            heapq.heappop(starts)
        if not starts:
            return
        seen: list[int] = []
        try:
            last = -1
            while starts:
                start = heapq.heappop(starts)
                seen.append(start)
                if start == last or start not in by_start:
                    continue
                last = start
                yield start, by_start[start]
        finally:
            for start in seen:
                if start in by_start:
                    heapq.heappush(starts, start)

    def take_scattered(self, length: int) -> list[tuple[int, int]]:
        """Take `length` free pages as few runs as possible (largest runs first).

        The caller checks `free_pages >= length` first; the result covers exactly `length` pages.
        """
        self.settle()
        if length > self.free_pages:
            raise PoolCorrupted(f"take_scattered: {length} pages asked, {self.free_pages} free")
        taken: list[tuple[int, int]] = []
        need = length
        while need:
            c = self._mask.bit_length() - 1
            runs = self._classes[c]
            if c >= _EXACT_CLASSES:
                start = max(runs, key=self._by_start.__getitem__)
                del runs[start]
            else:
                start = runs.popitem()[0]
            run_len = self._by_start[start]
            part = min(run_len, need)
            self._split(start, run_len, c, part)
            taken.append((start, part))
            need -= part
        return taken

    def take_range(self, start: int, length: int) -> None:
        """Remove the free pages `[start, start + length)`, which must all be free (for shrink)."""
        self.settle()
        run_start = self.run_containing(start)
        if run_start is None:
            raise PoolCorrupted(f"take_range: page {start} is not free")
        run_len = self._by_start[run_start]
        if start + length > run_start + run_len:
            raise PoolCorrupted(f"take_range: pages {start}..{start + length - 1} are not all free")
        self._remove(run_start, run_len)
        if start > run_start:
            self._insert(run_start, start - run_start)
        if run_start + run_len > start + length:
            self._insert(start + length, run_start + run_len - start - length)
        self.free_pages -= length

    def run_containing(self, page: int) -> int | None:
        """The start of the free run holding `page`, or None. O(number of runs); not a hot path."""
        self.settle()
        if page in self._by_start:
            return page
        for start, length in self._by_start.items():
            if start <= page < start + length:
                return start
        return None

    def largest(self) -> int:
        """Length of the largest free run (0 when nothing is free)."""
        self.settle()
        if not self._mask:
            return 0
        c = self._mask.bit_length() - 1
        if c < _EXACT_CLASSES:
            return c
        return max(self._by_start[s] for s in self._classes[c])

    def runs(self) -> Iterator[tuple[int, int]]:
        """Every free run as (start, length), in increasing page order."""
        self.settle()
        for start in sorted(self._by_start):
            yield start, self._by_start[start]
