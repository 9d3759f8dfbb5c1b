"""ContiguousAllocator: exact first-fit placement and coalescing, fragmentation, a model check."""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvctl.agent.pool import PagePool
from kvctl.simulate.contiguous import ContiguousAllocator, OutOfMemory


def test_first_fit_and_coalescing_step_by_step() -> None:
    arena = ContiguousAllocator(100)
    assert arena.allocate("A", 30) == 0
    assert arena.allocate("B", 20) == 30
    assert arena.allocate("C", 40) == 50
    assert arena.free_ranges() == [(90, 10)]
    # A[0,30) B[30,50) C[50,90) free[90,100)

    arena.free("B")  # no free neighbour: a new hole
    assert arena.free_ranges() == [(30, 20), (90, 10)]

    # first fit takes the lowest hole that fits, not the exact fit at 90
    assert arena.allocate("D", 10) == 30
    assert arena.free_ranges() == [(40, 10), (90, 10)]
    # A[0,30) D[30,40) free[40,50) C[50,90) free[90,100)

    with pytest.raises(OutOfMemory):  # 20 free in total, but no single range of 15
        arena.allocate("E", 15)
    assert arena.free_ranges() == [(40, 10), (90, 10)]
    assert (arena.alloc_attempts, arena.alloc_failures) == (5, 1)

    arena.free("C")  # merges with both neighbours
    assert arena.free_ranges() == [(40, 60)]
    arena.free("A")  # D sits between: nothing to merge
    assert arena.free_ranges() == [(0, 30), (40, 60)]
    assert arena.allocate("F", 50) == 40  # skips the hole at 0 that is too small
    assert arena.free_ranges() == [(0, 30), (90, 10)]
    arena.free("D")  # merges with its left neighbour only
    assert arena.free_ranges() == [(0, 40), (90, 10)]
    arena.free("F")  # merges with both: the arena is whole again
    assert arena.free_ranges() == [(0, 100)]
    arena.check_invariants()


def test_free_merges_with_right_neighbour_only() -> None:
    arena = ContiguousAllocator(30)
    for key in "ABC":
        arena.allocate(key, 10)
    arena.free("C")
    arena.free("B")
    assert arena.free_ranges() == [(10, 20)]
    arena.check_invariants()


def test_reserved_and_used_accounting() -> None:
    arena = ContiguousAllocator(100)
    arena.allocate("A", 40)
    arena.allocate("B", 30)
    arena.set_used("A", 10)
    arena.set_used("B", 30)
    arena.set_used("A", 25)
    stats = arena.stats()
    assert (stats.reserved, stats.used, stats.free, stats.ranges) == (70, 55, 30, 2)
    with pytest.raises(ValueError):
        arena.set_used("A", 41)
    arena.free("A")
    assert (arena.reserved_bytes, arena.used_bytes) == (30, 30)


def test_bad_requests_change_nothing() -> None:
    arena = ContiguousAllocator(10)
    arena.allocate("A", 4)
    with pytest.raises(ValueError):
        arena.allocate("A", 1)
    with pytest.raises(ValueError):
        arena.allocate("B", 0)
    with pytest.raises(KeyError):
        arena.free("nobody")
    assert arena.free_ranges() == [(4, 6)]
    assert arena.alloc_attempts == 1


def _arena_with_holes(capacity: int, holes: list[tuple[int, int]]) -> ContiguousAllocator:
    """An arena whose free ranges are exactly `holes`: fill it unit by unit, free the holes."""
    arena = ContiguousAllocator(capacity)
    for unit in range(capacity):
        arena.allocate(unit, 1)
    for start, length in holes:
        for unit in range(start, start + length):
            arena.free(unit)
    assert arena.free_ranges() == holes
    return arena


@pytest.mark.parametrize(
    ("holes", "expected"),
    [
        ([], 0.0),  # nothing free: 0 by definition
        ([(0, 100)], 0.0),  # one free range
        ([(0, 10), (20, 30), (60, 20)], 1 - 30 / 60),
        ([(0, 1), (2, 1), (4, 1), (6, 1)], 0.75),
    ],
)
def test_fragmentation_is_one_minus_largest_over_free(holes, expected) -> None:
    arena = _arena_with_holes(100, holes)
    stats = arena.stats()
    assert stats.fragmentation_ratio == pytest.approx(expected)
    assert stats.free_extents == len(holes)


def test_fragmentation_matches_the_pool_on_the_same_layout() -> None:
    holes = [(1, 2), (5, 4), (12, 3)]
    arena = _arena_with_holes(16, holes)
    pool = PagePool(16, page_size=1)
    for page in range(16):
        pool.allocate(page, 1)
    for start, length in holes:
        for page in range(start, start + length):
            pool.free(page)
    assert pool.pages.free_runs() == holes
    assert arena.stats().fragmentation_ratio == pool.stats().fragmentation_ratio


class ArenaAgainstModel(RuleBasedStateMachine):
    """Random allocate/free against a unit-by-unit model of first-fit."""

    CAPACITY = 48

    def __init__(self) -> None:
        super().__init__()
        self.arena = ContiguousAllocator(self.CAPACITY)
        self.owner: list[int | None] = [None] * self.CAPACITY
        self.next_key = 0

    def _model_first_fit(self, size: int) -> int | None:
        run = 0
        for unit, owner in enumerate(self.owner):
            run = run + 1 if owner is None else 0
            if run == size:
                return unit - size + 1
        return None

    @rule(size=st.integers(1, 20))
    def allocate(self, size: int) -> None:
        key, self.next_key = self.next_key, self.next_key + 1
        expected = self._model_first_fit(size)
        if expected is None:
            with pytest.raises(OutOfMemory):
                self.arena.allocate(key, size)
            return
        assert self.arena.allocate(key, size) == expected
        self.owner[expected : expected + size] = [key] * size

    @precondition(lambda self: any(o is not None for o in self.owner))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted({o for o in self.owner if o is not None})))
        self.arena.free(key)
        self.owner = [None if o == key else o for o in self.owner]

    @invariant()
    def free_ranges_match_the_model(self) -> None:
        self.arena.check_invariants()
        runs, start = [], None
        for unit, owner in enumerate([*self.owner, 0]):
            if owner is None and start is None:
                start = unit
            elif owner is not None and start is not None:
                runs.append((start, unit - start))
                start = None
        assert self.arena.free_ranges() == runs


TestArenaAgainstModel = ArenaAgainstModel.TestCase
