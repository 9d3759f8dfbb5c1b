"""Random operation sequences against the pool with real page contents.

Every token written gets a distinct tag in the real `KVStorage`; after every step each sequence
must read back exactly its tokens' tags through its (possibly moved) page table, pages held by
the prefix cache must keep their contents, and the pool's own leak check must hold (it covers
the growth reservations, the loose pages and the owner index too). A page given to two owners,
lost in a move, or released while held would show up as a wrong tag.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)
from kv_device import DEVICE

from kvctl.agent.pool import (
    Defragmenter,
    DefragTrigger,
    PagePool,
    PoolError,
    PoolExhausted,
    PoolResizer,
    ResizeRefused,
)
from kvctl.agent.pool.storage import KVStorage

PAGE_SIZE = 4
SEGMENT_PAGES = 8
MAX_PAGES = 6 * SEGMENT_PAGES


class PoolMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")

    @initialize(segments=st.integers(1, 3), batch=st.integers(1, 5), reserve=st.integers(1, 4))
    def start(self, segments: int, batch: int, reserve: int) -> None:
        pages = segments * SEGMENT_PAGES
        self.pool = PagePool(pages, PAGE_SIZE, SEGMENT_PAGES, reserve_pages=reserve)
        self.storage = KVStorage(
            segments, SEGMENT_PAGES, PAGE_SIZE, 1, 1, 1, torch.float64, device=DEVICE
        )
        self.defrag = Defragmenter(self.pool, self.storage, batch_pages=batch)
        self.resizer = PoolResizer(self.pool, self.defrag, self.storage, max_pages=MAX_PAGES)
        self.tags: dict[int, list[float]] = {}  # expected tag of every token of every sequence
        self.held: dict[int, torch.Tensor] = {}  # page -> contents when the cache took it
        self.pool.relocation.add_listener(self._follow_held)
        self.ids = itertools.count()
        self.next_tag = itertools.count(1)

    def _follow_held(self, moves: dict[int, int]) -> None:
        self.held = {moves.get(p, p): contents for p, contents in self.held.items()}

    def _write(self, seq: int, first: int, count: int) -> None:
        """Write fresh tags into tokens [first, first + count) of `seq`."""
        pages = self.pool.table(seq).positional()
        positions = range(first, first + count)
        tags = [float(next(self.next_tag)) for _ in positions]
        slot_pages = torch.tensor([pages[t // PAGE_SIZE] for t in positions])
        slot_offsets = torch.tensor([t % PAGE_SIZE for t in positions])
        values = torch.tensor(tags, dtype=torch.float64).view(-1, 1, 1)
        self.storage.write(0, slot_pages, slot_offsets, values, values)
        self.tags[seq].extend(tags)

    def _snapshot(self) -> tuple:
        """What a refused call must leave as it was: every page's state and every table. Not
        the free extents: a refused call first takes growth reservations back (reserved pages
        are free pages set aside, returned before anything fails), so a reserved page may show
        up in the extents afterwards, still free."""
        return (
            self.pool.capacity,
            self.pool.pages.map(),
            {s: list(self.pool.table(s).pages) for s in self.tags},
            self.storage.num_pages,
        )

    @rule(target=sequences, tokens=st.integers(0, 24))
    def allocate(self, tokens: int):
        seq = next(self.ids)
        if not self.pool.can_allocate(tokens):
            before = self._snapshot()
            try:
                self.pool.allocate(seq, tokens)
            except PoolExhausted:
                assert self._snapshot() == before
                return None
            raise AssertionError("allocate succeeded although can_allocate said no")
        self.pool.allocate(seq, tokens)
        self.tags[seq] = []
        self._write(seq, 0, tokens)
        return seq

    @rule(seq=sequences, tokens=st.integers(1, 9))
    def append(self, seq, tokens: int) -> None:
        if seq is None or seq not in self.tags:
            return
        if not self.pool.can_append(seq, tokens):
            before = self._snapshot()
            try:
                self.pool.append(seq, tokens)
            except PoolExhausted:
                assert self._snapshot() == before
                return
            raise AssertionError("append succeeded although can_append said no")
        first = self.pool.table(seq).num_tokens
        copies = self.pool.append(seq, tokens)
        if copies:
            self.storage.copy_pages([c.src for c in copies], [c.dst for c in copies])
        self._write(seq, first, tokens)

    @rule(tokens=st.integers(1, PAGE_SIZE))
    def decode_step(self, tokens: int) -> None:
        """Every sequence grows, as in a decode step; those that cannot are left as they are."""
        for seq in list(self.tags):
            if self.pool.can_append(seq, tokens):
                first = self.pool.table(seq).num_tokens
                copies = self.pool.append(seq, tokens)
                if copies:
                    self.storage.copy_pages([c.src for c in copies], [c.dst for c in copies])
                self._write(seq, first, tokens)

    @rule(target=sequences, seq=sequences, data=st.data())
    def adopt(self, seq, data):
        """A prefix hit: a new sequence starts on pages the cache holds, then writes its own."""
        if seq is None or seq not in self.tags or self.pool.table(seq).dropped:
            return None
        prefix = []
        for page in self.pool.table(seq).pages:
            if page not in self.held:
                break
            prefix.append(page)
        known = len(self.tags[seq])
        if not prefix or known == 0:
            return None
        pages = data.draw(st.integers(1, min(len(prefix), -(-known // PAGE_SIZE))))
        shared = data.draw(st.integers((pages - 1) * PAGE_SIZE + 1, min(pages * PAGE_SIZE, known)))
        extra = data.draw(st.integers(0, 6))
        child = next(self.ids)
        before = self._snapshot()
        try:
            _, copies = self.pool.adopt(child, prefix[:pages], shared, shared + extra)
        except PoolExhausted:
            assert self._snapshot() == before
            return None
        if copies:
            self.storage.copy_pages([c.src for c in copies], [c.dst for c in copies])
        self.tags[child] = self.tags[seq][:shared]
        self._write(child, shared, extra)
        return child

    @rule(seq=sequences, data=st.data())
    def release_front(self, seq, data) -> None:
        """A sliding window moved on: the sequence gives back front pages and keeps the rest
        (the tokens of those pages are no longer read through it)."""
        if seq is None or seq not in self.tags:
            return
        held = len(self.pool.table(seq).pages)
        if held < 2:
            with pytest.raises(PoolError):
                self.pool.release_front(seq, held)
            return
        count = data.draw(st.integers(1, held - 1))
        free, used = self.pool.free_pages, self.pool.used_pages
        self.pool.release_front(seq, count)
        event("front pages given back")
        assert self.pool.free_pages + self.pool.cached_pages >= free
        assert self.pool.used_pages <= used

    @rule()
    def release_reservations(self) -> None:
        free = self.pool.free_pages
        self.pool.sizing.release_reservations()
        assert self.pool.reserved_pages == 0 and self.pool.free_pages == free

    @rule(target=sequences, seq=sequences)
    def fork(self, seq):
        if seq is None or seq not in self.tags:
            return None
        child = next(self.ids)
        self.pool.fork(seq, child)
        self.tags[child] = list(self.tags[seq])
        return child

    @rule(seq=consumes(sequences))
    def free(self, seq) -> None:
        if seq is None or seq not in self.tags:
            return
        self.pool.free(seq)
        del self.tags[seq]

    @rule(seq=sequences)
    def cache_pages(self, seq) -> None:
        """The prefix cache takes the sequence's pages; their contents must now stay fixed."""
        if seq is None or seq not in self.tags:
            return
        pages = [p for p in self.pool.table(seq).pages if p not in self.held]
        if pages:
            self.pool.holds.hold(pages)
            for page, contents in zip(pages, self.storage.read_pages(pages), strict=True):
                self.held[page] = contents

    @precondition(lambda self: bool(self.held))
    @rule(count=st.integers(1, 4))
    def evict(self, count: int) -> None:
        victims = sorted(self.held)[:count]
        self.pool.holds.release(victims)
        for page in victims:
            del self.held[page]

    @rule(pages=st.integers(1, 6))
    def defrag_step(self, pages: int) -> None:
        self.defrag.step(pages)

    @rule()
    def full_defrag(self) -> None:
        report = self.defrag.run(DefragTrigger.MANUAL)
        assert report.complete
        assert self.pool.stats().fragmentation_ratio == 0.0
        assert report.fragmentation_after == 0.0

    @rule(segments=st.integers(1, 2))
    def grow(self, segments: int) -> None:
        target = self.pool.capacity + segments * SEGMENT_PAGES
        if target <= MAX_PAGES:
            assert self.resizer.resize(target).new_pages == target

    @rule(segments=st.integers(1, 4))
    def shrink(self, segments: int) -> None:
        target = self.pool.capacity - segments * SEGMENT_PAGES
        if target < SEGMENT_PAGES:
            return
        before = self._snapshot()
        try:
            result = self.resizer.resize(target)
        except ResizeRefused:
            assert self._snapshot() == before
            assert self.pool.used_pages > target or self.pool.cached_pages
            return
        assert result.new_pages == target == self.pool.capacity == self.storage.num_pages

    @invariant()
    def contents_and_bookkeeping_hold(self) -> None:
        if not hasattr(self, "pool"):
            return
        if self.pool.reserved_pages:
            event("pages reserved for growth")
        if self.pool._loose:
            event("loose pages")
        self.pool.invariants.check()
        assert self.storage.num_pages == self.pool.capacity
        for seq, expected in self.tags.items():
            table = self.pool.table(seq)
            assert table.num_tokens == len(expected)
            if not expected:
                continue
            kept = expected[table.dropped * PAGE_SIZE :]  # the tokens it still holds
            pages = self.storage.read_pages(table.pages)[:, 0, 0, :, 0, 0].reshape(-1)
            assert pages[: len(kept)].tolist() == kept, f"sequence {seq} lost tokens"
        for page, contents in self.held.items():
            assert self.pool.pages.state(page).value in ("used", "cached")
            assert torch.equal(self.storage.read_pages([page])[0], contents), f"page {page}"


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
TestPoolMachine = PoolMachine.TestCase
