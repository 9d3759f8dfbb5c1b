"""FreeExtents: exact runs after each operation on tiny free spaces."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.agent.pool.extents import FreeExtents, size_class


def runs(ext: FreeExtents) -> list[tuple[int, int]]:
    return list(ext.runs())


def test_size_classes_are_exact_below_64_then_by_bit_length() -> None:
    assert [size_class(n) for n in (1, 2, 63)] == [1, 2, 63]
    assert size_class(64) == size_class(127) == 64
    assert size_class(128) == 65


def test_give_coalesces_with_both_neighbours() -> None:
    ext = FreeExtents()
    ext.give(0, 2)
    ext.give(5, 3)
    assert runs(ext) == [(0, 2), (5, 3)]
    ext.give(2, 3)  # fills the hole between them
    assert runs(ext) == [(0, 8)]
    assert (len(ext), ext.free_pages, ext.largest()) == (1, 8, 8)


def test_take_run_is_best_fit_and_serves_from_the_low_end() -> None:
    ext = FreeExtents()
    ext.give(0, 10)
    ext.give(20, 3)
    assert ext.take_run(3) == 20  # the exact-size run, not the big one
    assert runs(ext) == [(0, 10)]
    assert ext.take_run(4) == 0
    assert runs(ext) == [(4, 6)]
    assert ext.take_run(7) is None
    assert ext.free_pages == 6


def test_take_run_searches_large_classes_for_a_fitting_run() -> None:
    ext = FreeExtents()
    ext.give(0, 70)  # same class (64..127) as 100 but too small
    ext.give(200, 300)
    assert ext.take_run(100) == 200
    assert runs(ext) == [(0, 70), (300, 200)]


def test_take_scattered_takes_largest_runs_first() -> None:
    ext = FreeExtents()
    ext.give(0, 2)
    ext.give(4, 5)
    ext.give(12, 1)
    assert ext.take_scattered(6) == [(4, 5), (0, 1)]
    assert runs(ext) == [(1, 1), (12, 1)]
    assert ext.free_pages == 2


def test_take_range_splits_a_run() -> None:
    ext = FreeExtents()
    ext.give(0, 10)
    ext.take_range(3, 2)
    assert runs(ext) == [(0, 3), (5, 5)]
    with pytest.raises(AssertionError):
        ext.take_range(2, 2)  # page 3 is no longer free
    assert runs(ext) == [(0, 3), (5, 5)]


def test_take_run_at_the_boundary_of_the_exact_classes() -> None:
    ext = FreeExtents()
    ext.give(0, 100)  # class 64 holds runs of 64..127 pages
    assert ext.take_run(64) == 0
    assert runs(ext) == [(64, 36)]
    ext.give(200, 64)
    assert ext.take_run(64) == 200
    assert ext.take_run(63) is None
    assert ext.take_run(36) == 64


def test_a_freed_short_run_is_reused_as_is_and_read_coalesced() -> None:
    ext = FreeExtents()
    ext.give(0, 32)
    assert [ext.take_run(4) for _ in range(3)] == [0, 4, 8]
    ext.give(4, 4)  # listed for reuse, not merged yet
    assert ext.take_run(4) == 4  # an exact fit, taken back as it was
    ext.give(4, 4)
    ext.give(0, 4)
    assert ext.free_pages == 28
    # another size settles first: [0, 4) and [4, 8) merge into the best fit for 5 pages
    assert ext.take_run(5) == 0
    assert runs(ext) == [(5, 3), (12, 20)]
    assert (len(ext), ext.largest()) == (2, 20)


def test_reads_coalesce_any_number_of_freed_runs() -> None:
    ext = FreeExtents()
    ext.give(0, 2000)
    starts = [ext.take_run(1) for _ in range(2000)]
    for start in starts[::2]:  # 1,000 runs of one page, none touching
        ext.give(start, 1)
    assert (len(ext), ext.largest(), ext.free_pages) == (1000, 1, 1000)
    for start in starts[1::2]:
        ext.give(start, 1)
    assert runs(ext) == [(0, 2000)]


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 150), st.booleans()), max_size=60))
def test_random_takes_and_gives_keep_runs_exact(ops: list[tuple[bool, int, bool]]) -> None:
    """Against a set of free pages: every take_run returns free pages and finds a run whenever
    one exists, and runs read back maximal. Reads come at random steps, so freed runs are
    sometimes still waiting to be coalesced when the next take comes."""
    ext = FreeExtents()
    ext.give(0, 1000)
    free = set(range(1000))
    taken: list[tuple[int, int]] = []
    for is_take, n, read in ops:
        if is_take or not taken:
            start = ext.take_run(n)
            has_run = any(all(p in free for p in range(s, s + n)) for s in free)
            assert (start is not None) == has_run
            if start is not None:
                assert all(p in free for p in range(start, start + n))
                free -= set(range(start, start + n))
                taken.append((start, n))
        else:
            start, length = taken.pop(n % len(taken))
            ext.give(start, length)
            free |= set(range(start, start + length))
        assert ext.free_pages == len(free)
        if not read:
            continue
        expected_runs = []
        for p in sorted(free):
            if expected_runs and expected_runs[-1][0] + expected_runs[-1][1] == p:
                expected_runs[-1][1] += 1
            else:
                expected_runs.append([p, 1])
        assert runs(ext) == [tuple(r) for r in expected_runs]
        assert ext.largest() == max((r[1] for r in expected_runs), default=0)


@given(
    st.lists(
        st.tuples(st.sampled_from(["take", "give", "at", "smallest"]), st.integers(1, 40)),
        min_size=50,
        max_size=400,
    )
)
def test_lowest_runs_read_every_run_in_order_through_heap_rebuilds(
    ops: list[tuple[str, int]],
) -> None:
    """The heap of run starts the defragmenter reads must never lose a run: long random
    sequences (long enough that stale entries force rebuilds) against the sorted runs."""
    ext = FreeExtents()
    ext.give(0, 2000)
    taken: list[tuple[int, int]] = []
    for op, n in ops:
        if op == "take" or (op == "give" and not taken):
            start = ext.take_run(n)
            if start is not None:
                taken.append((start, n))
        elif op == "give":
            start, length = taken.pop(n % len(taken))
            ext.give(start, length)
        elif op == "at" and taken:
            start, length = taken[n % len(taken)]
            got = ext.take_at(start + length, n)
            if got:
                taken.append((start + length, got))
        elif op == "smallest":
            shred = ext.take_smallest(n)
            if shred is not None:
                taken.append(shred)
        assert list(ext.lowest_runs()) == runs(ext)
