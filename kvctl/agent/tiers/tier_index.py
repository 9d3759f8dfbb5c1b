"""Which pages a tier holds, in which slot, and which goes first when it needs room.

A tier is a flat array of `capacity` page slots (host memory) or a bounded set of files (disk);
the index maps page digests to entries and keeps the eviction order of the prefix cache's
policies (lru, lfu, fifo: the same classes, reading the same fields). Entries are independent
pages, not a tree, so a chain's pages are touched deepest first: the deepest page gets the oldest
tick and goes first, and a prefix is never cut in the middle while its tail survives.

The order is a lazy heap: a touch pushes a new heap item and leaves the old one, which is
skipped when it comes first (its version is stale); the heap is rebuilt when stale items
outnumber live ones, so eviction costs O(log n) per page.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from kvctl.agent.pool.errors import InvariantViolated
from kvctl.agent.prefix.eviction import EvictionPolicy, make_policy


class TierCorrupted(InvariantViolated):
    """A tier's index disagrees with itself (slots, free slots, eviction order)."""


@dataclass(eq=False, slots=True)
class TierEntry:
    """One page in a tier: its digest, slot and what eviction policies read."""

    digest: bytes
    slot: int
    node_id: int  # serial: ties break towards the page stored first
    created: int
    last_access: int
    hits: int = 0
    version: int = 0
    root: bytes = b""  # the digest of the partition the page belongs to (a purge's filter)


@dataclass
class TierIndex:
    """Digest → entry for one tier, with free slots and the eviction order."""

    capacity: int
    policy: EvictionPolicy = field(default_factory=lambda: make_policy("lru"))
    entries: dict[bytes, TierEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError("a tier's capacity must be 0 or more pages")
        # Free slots: every slot from `_fresh` up, and the released ones below it in `_free` (a
        # heap: the lowest is reused first). Lazy, so a disk tier of a billion pages costs
        # nothing until pages arrive.
        self._fresh = 0
        self._free: list[int] = []
        self._heap: list[tuple[tuple[int, ...], int, TierEntry]] = []
        self._clock = 0
        self._serial = 0
        # told `(digests, stored)` of every page taken or let go (the agent's KV events)
        self.on_change: Callable[[list[bytes], bool], None] | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, digest: object) -> bool:
        return digest in self.entries

    def get(self, digest: bytes) -> TierEntry | None:
        return self.entries.get(digest)

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.entries)

    def _take_slot(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._fresh += 1
        return self._fresh - 1

    def set_policy(self, name: str) -> None:
        self.policy = make_policy(name)
        self._rebuild()

    # ---- changes --------------------------------------------------------------------------

    def add(self, digests: list[bytes]) -> list[TierEntry]:
        """New entries for `digests` (not yet in the tier, at most `free_slots` of them), in
        the order given: a chain's pages from the shallowest. Their ticks run deepest first."""
        if len(digests) > self.free_slots:
            raise ValueError(f"{len(digests)} pages need slots and {self.free_slots} are free")
        entries = []
        ticks = self._ticks(len(digests))
        for digest, tick in zip(digests, ticks, strict=True):
            self._serial += 1
            entry = TierEntry(digest, self._take_slot(), self._serial, tick, tick)
            self.entries[digest] = entry
            entries.append(entry)
            self._push(entry)
        if self.on_change is not None:
            self.on_change(digests, True)
        return entries

    def touch(self, entries: list[TierEntry], hit: bool = True) -> None:
        """Mark a chain's pages (shallowest first) used now, the deepest the least recently; a
        `hit` (a load, not a store of a page already held) also counts for lfu."""
        for entry, tick in zip(entries, self._ticks(len(entries)), strict=True):
            entry.last_access = tick
            entry.hits += hit
            entry.version += 1
            self._push(entry)

    def remove(self, entry: TierEntry) -> None:
        """Forget a page (its slot is free again)."""
        if self.entries.get(entry.digest) is entry:
            del self.entries[entry.digest]
            entry.version += 1
            if entry.slot < self.capacity:
                heapq.heappush(self._free, entry.slot)
            if self.on_change is not None:
                self.on_change([entry.digest], False)

    def victims(self, count: int, spare: Collection[TierEntry] = ()) -> list[TierEntry]:
        """Take up to `count` entries out of the tier in eviction order and return them (their
        slots are free once the caller has read what it keeps of them). Entries in `spare`
        stay, whatever their place in the order (the pages of a chain being stored)."""
        out: list[TierEntry] = []
        spared = {id(e) for e in spare}
        skipped = []
        heap = self._heap
        while heap and len(out) < count:
            item = heapq.heappop(heap)
            _, version, entry = item
            if version != entry.version or self.entries.get(entry.digest) is not entry:
                continue
            if id(entry) in spared:
                skipped.append(item)
                continue
            self.remove(entry)
            out.append(entry)
        for item in skipped:
            heapq.heappush(heap, item)
        return out

    def resize(self, capacity: int) -> tuple[list[TierEntry], list[tuple[TierEntry, int]]]:
        """Set the capacity: returns the entries evicted to fit it, and the moves
        `(entry, old slot)` of the entries that were above it and now have a slot below it
        (their contents must be copied from the old slot to `entry.slot`)."""
        if capacity < 0:
            raise ValueError("a tier's capacity must be 0 or more pages")
        evicted = self.victims(len(self.entries) - capacity) if len(self.entries) > capacity else []
        self.capacity = capacity
        if self._fresh <= capacity:  # every slot in use is below the new size
            return evicted, []
        # every slot below the new size is now in use or in `_free`: enough for those above
        self._fresh = capacity
        self._free = [s for s in self._free if s < capacity]
        heapq.heapify(self._free)
        moves = []
        for entry in self.entries.values():
            if entry.slot >= capacity:
                moves.append((entry, entry.slot))
                entry.slot = heapq.heappop(self._free)
        return evicted, moves

    # ---- order ----------------------------------------------------------------------------

    def _ticks(self, count: int) -> list[int]:
        """`count` new clock ticks, the first page's the newest."""
        start = self._clock + 1
        self._clock += count
        return list(range(self._clock, start - 1, -1))

    def _push(self, entry: TierEntry) -> None:
        heapq.heappush(self._heap, (self.policy.priority(entry), entry.version, entry))
        if len(self._heap) > 2 * len(self.entries) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self.policy.priority(e), e.version, e) for e in self.entries.values()]
        heapq.heapify(self._heap)

    # ---- checking -------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """What is wrong with the index (empty when nothing): slots unique and in range, free
        slots and entries partition the capacity, every entry reachable in the order."""
        out = []
        slots = [e.slot for e in self.entries.values()]
        if len(set(slots)) != len(slots):
            out.append("two pages share a slot")
        if any(not 0 <= s < self.capacity for s in slots):
            out.append("a page's slot is outside the capacity")
        released = set(self._free)
        below = self._fresh
        if (
            released & set(slots)
            or len(released) != len(self._free)
            or any(s >= below for s in (*slots, *released))
            or len(slots) + len(released) != below
            or below > self.capacity
        ):
            out.append("free slots and pages do not cover the capacity exactly once")
        live = {id(e) for _, v, e in self._heap if v == e.version}
        if any(id(e) not in live for e in self.entries.values()):
            out.append("a page is missing from the eviction order")
        if any(d != e.digest for d, e in self.entries.items()):
            out.append("an entry is filed under another digest")
        return out

    def check(self) -> None:
        """Raise `TierCorrupted` naming every problem, if there is any."""
        found = self.problems()
        if found:
            raise TierCorrupted("; ".join(found))
