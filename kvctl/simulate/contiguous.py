"""The traditional KV allocator: one contiguous range per request, first-fit, coalescing on free.

This is the baseline `kvctl simulate` compares the paged pool against. A request reserves room for
its prompt *and* its maximum output as one range of a fixed arena, the way servers without paging
keep a request's KV cache in one tensor: memory past the tokens actually written is reserved but
holds nothing (internal fragmentation), and ranges that die at different times leave holes that a
larger request cannot use (external fragmentation).

Free space is two parallel lists in address order, `starts` and `lengths`. `bisect` over the starts
finds a freed range's neighbours in O(log n) and inserting or deleting a list entry is a memmove,
so coalescing stays cheap with thousands of ranges. First-fit is by definition a scan in address
order; a `max` over the lengths (C speed) rejects a request no range can hold before scanning.

Units are whatever the caller uses consistently (the simulator uses bytes). Plain Python, no torch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable
from dataclasses import dataclass
from itertools import pairwise

from kvctl.agent.pool.errors import InvariantViolated
from kvctl.occupancy import fragmentation_of

Key = Hashable


class OutOfMemory(Exception):
    """No single free range holds the request, though the arena may have enough free in total."""


class ArenaCorrupted(InvariantViolated):
    """The free list and the ranges disagree: a bug, never a user error."""


@dataclass(frozen=True)
class ArenaStats:
    """One reading of the arena: reservations, real use, free space and its shape, counters."""

    capacity: int
    reserved: int  # held by ranges
    used: int  # of the reserved, what holds real data
    free: int
    largest_free: int
    free_extents: int
    ranges: int
    alloc_attempts: int
    alloc_failures: int

    @property
    def fragmentation_ratio(self) -> float:
        """1 − largest free range ÷ total free; 0 when nothing is free (the pool's definition)."""
        return fragmentation_of(self.largest_free, self.free)


class ContiguousAllocator:
    """A fixed arena handing out one contiguous range per key, first-fit by address.

    Guarantees, checked by `check_invariants`: free ranges never overlap and never touch (a freed
    range merges with both neighbours at once), so `free_extents` is the number of holes; reserved +
    free == capacity; a failed allocation changes nothing but the failure counter.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._starts: list[int] = [0]
        self._lengths: list[int] = [capacity]
        self._ranges: dict[Key, tuple[int, int]] = {}  # key -> (start, size)
        self._used: dict[Key, int] = {}
        self.free_bytes = capacity
        self.used_bytes = 0
        self.alloc_attempts = 0
        self.alloc_failures = 0

    # ---- reading ------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        return self.capacity - self.free_bytes

    def largest_free(self) -> int:
        return max(self._lengths, default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        """Free ranges as (start, length), in address order."""
        return list(zip(self._starts, self._lengths, strict=True))

    def range_of(self, key: Key) -> tuple[int, int]:
        """The (start, size) reserved for `key`."""
        try:
            return self._ranges[key]
        except KeyError:
            raise KeyError(f"{key!r} holds no range") from None

    def __contains__(self, key: Key) -> bool:
        return key in self._ranges

    def stats(self) -> ArenaStats:
        return ArenaStats(
            capacity=self.capacity,
            reserved=self.reserved_bytes,
            used=self.used_bytes,
            free=self.free_bytes,
            largest_free=self.largest_free(),
            free_extents=len(self._starts),
            ranges=len(self._ranges),
            alloc_attempts=self.alloc_attempts,
            alloc_failures=self.alloc_failures,
        )

    # ---- allocation ---------------------------------------------------------------------

    def can_allocate(self, size: int) -> bool:
        """Whether `allocate` of `size` would succeed (some single free range holds it)."""
        return size <= self.largest_free()

    def allocate(self, key: Key, size: int) -> int:
        """Reserve `size` units for `key` at the lowest address where they fit; return the start.

        Raises `OutOfMemory` (and counts a failure) when no single free range is large enough,
        however much is free in total; the arena is then unchanged.
        """
        if key in self._ranges:
            raise ValueError(f"{key!r} already holds a range")
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.alloc_attempts += 1
        lengths = self._lengths
        if size > max(lengths, default=0):
            self.alloc_failures += 1
            raise OutOfMemory(
                f"no free range of {size} (largest {self.largest_free()}, {self.free_bytes} free "
                f"in {len(lengths)} ranges); wait for requests to finish"
            )
        i = next(i for i, length in enumerate(lengths) if length >= size)
        start = self._starts[i]
        if lengths[i] == size:
            del self._starts[i]
            del lengths[i]
        else:
            self._starts[i] = start + size
            lengths[i] -= size
        self._ranges[key] = (start, size)
        self._used[key] = 0
        self.free_bytes -= size
        return start

    def set_used(self, key: Key, used: int) -> None:
        """Record how much of `key`'s range holds real data (reserved vs used accounting)."""
        _, size = self.range_of(key)
        if not 0 <= used <= size:
            raise ValueError(f"{key!r}: used {used} outside its range of {size}")
        self.used_bytes += used - self._used[key]
        self._used[key] = used

    def free(self, key: Key) -> None:
        """Return `key`'s range to the free space, merging it with free neighbours on both sides."""
        start, size = self.range_of(key)
        del self._ranges[key]
        self.used_bytes -= self._used.pop(key)
        self.free_bytes += size
        starts, lengths = self._starts, self._lengths
        i = bisect_left(starts, start)
        merge_left = i > 0 and starts[i - 1] + lengths[i - 1] == start
        merge_right = i < len(starts) and start + size == starts[i]
        if merge_left and merge_right:
            lengths[i - 1] += size + lengths[i]
            del starts[i]
            del lengths[i]
        elif merge_left:
            lengths[i - 1] += size
        elif merge_right:
            starts[i] = start
            lengths[i] += size
        else:
            starts.insert(i, start)
            lengths.insert(i, size)

    # ---- invariants ---------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise `ArenaCorrupted` if the free list, the ranges and the counters disagree."""
        spans = sorted([*self._ranges.values(), *self.free_ranges()])
        cursor = 0
        for start, size in spans:
            if start != cursor or size < 1:
                raise ArenaCorrupted(f"gap, overlap or empty span at {cursor}..{start}")
            cursor = start + size
        if cursor != self.capacity:
            raise ArenaCorrupted("ranges and free ranges do not cover the arena")
        free = self.free_ranges()
        for (a, n), (b, _) in pairwise(free):
            if a + n >= b:
                raise ArenaCorrupted(f"free ranges at {a} and {b} touch: they should have merged")
        if self.free_bytes != sum(self._lengths):
            raise ArenaCorrupted("free counter differs from the free ranges")
        if self.used_bytes != sum(self._used.values()):
            raise ArenaCorrupted("used counter differs from the ranges")
