"""The pieces of the pool on their own: growth reservations, loose pages, the parts it lends
(cache holds, relocation, sizing, page readings) on its arrays, the invariant check.

The invariant check is tested by breaking one piece of bookkeeping on purpose and expecting the
part of the check that guards it (its message), so a test fails if that part is removed.
"""

from collections.abc import Callable

import pytest

from kvctl.agent.pool import PagePool, PageRun, PageState, PoolCorrupted, PoolExhausted
from kvctl.agent.pool.extents import FreeExtents
from kvctl.agent.pool.loose_pages import REFILL_PAGES, LoosePages
from kvctl.agent.pool.page_table import PageTable, as_run, run_starts_of, runs_of
from kvctl.agent.pool.reservations import Reservations

# ---- run helpers --------------------------------------------------------------------------


def test_runs_of_and_run_starts_of_cut_page_ids_into_maximal_ascending_runs() -> None:
    pages = [4, 5, 6, 9, 3, 4, 10]
    assert list(runs_of(pages)) == [(4, 3), (9, 1), (3, 2), (10, 1)]
    assert run_starts_of(pages) == [0, 3, 4, 6]
    assert list(runs_of([])) == [] and run_starts_of([0]) == [0]


def test_as_run_names_the_first_id_of_a_run_of_the_pools_own_ids() -> None:
    ids = list(range(16))
    assert as_run(ids[3:9], ids) == 3
    assert as_run([3, 4, 5], ids) is None  # under 4 pages: page by page is as cheap
    assert as_run([3, 4, 6, 6], ids) is None  # not consecutive
    assert as_run([14, 15, 16, 17], ids) is None  # past the pool


# ---- growth reservations ------------------------------------------------------------------


def reservations(pages: int = 64, limit: int = 8) -> tuple[FreeExtents, Reservations]:
    free = FreeExtents()
    free.give_now(0, pages)
    return free, Reservations(free, limit, pages)


def reserve(free: FreeExtents, res: Reservations, name: str, start: int, n: int) -> PageTable:
    """What the pool does: take the pages out of the free extents, then reserve them."""
    free.take_range(start, n)
    table = PageTable(name, [start - 1], 1, 1)
    res.add(table, start, n)
    return table


def test_a_reservation_is_sized_by_its_limit_and_an_eighth_of_the_pool() -> None:
    _, res = reservations(64, limit=128)
    assert res.size == 8  # 64 // 8
    res.fit(4096)
    assert res.size == 128  # the limit
    res.fit(4)
    assert res.size == 1  # at least one page


def test_dropping_a_reservation_gives_its_unused_pages_back() -> None:
    free, res = reservations()
    a = reserve(free, res, "a", 10, 6)
    assert (res.pages, a.reserved, list(res.tables)) == (6, 6, ["a"])
    assert free.free_pages == 58
    res.drop(a)
    assert (res.pages, a.reserved, res.tables) == (0, 0, {})
    assert free.free_pages == 64 and list(free.runs()) == [(0, 64)]
    res.drop(a)  # nothing left: nothing happens
    assert free.free_pages == 64


def test_a_drop_at_once_files_the_pages_where_take_at_finds_them() -> None:
    free, res = reservations()
    free.take_range(0, 64)  # nothing free but what the reservations give back
    later, now = PageTable("l", [9], 1, 1), PageTable("n", [19], 1, 1)
    res.add(later, 10, 4)
    res.add(now, 20, 4)
    res.drop(later)  # into the fast lists: not filed yet
    res.drop(now, at_once=True)
    assert free.take_at(10, 4) == 0
    assert free.take_at(20, 4) == 4


def test_release_all_and_reclaim_give_reservations_back_newest_first() -> None:
    free, res = reservations()
    free.take_range(0, 64)
    old = reserve_taken(res, "old", 0, 4)
    new = reserve_taken(res, "new", 10, 4)
    res.reclaim(3)  # the newest is enough
    assert (old.reserved, new.reserved, res.pages) == (4, 0, 4)
    assert res.release_all() == 4
    assert (old.reserved, res.pages, res.tables, free.free_pages) == (0, 0, {}, 8)


def reserve_taken(res: Reservations, name: str, start: int, n: int) -> PageTable:
    table = PageTable(name, [start - 1] if start else [], 1, 1)
    res.add(table, start, n)
    return table


def test_reserved_pages_taken_by_the_fast_path_count_as_handed_out() -> None:
    free, res = reservations()
    a = reserve(free, res, "a", 10, 3)
    for _ in range(2):  # what `PagePool.append` does inline, without a call
        a.reserve_next += 1
        res.pages -= 1
    assert res.handed_out == 2
    res.drop(a)  # the rest goes back: not handed out
    assert res.handed_out == 2 and res.pages == 0


# ---- loose pages --------------------------------------------------------------------------


def loose(pages: int = 200) -> tuple[FreeExtents, LoosePages]:
    free = FreeExtents()
    ids = list(range(pages))
    return free, LoosePages(free, ids)


def test_a_refill_moves_the_smallest_free_run_onto_the_stack_lowest_on_top() -> None:
    free, stack = loose()
    free.give_now(0, 100)
    free.give_now(150, 3)
    assert stack.refill()
    assert stack.pages == [152, 151, 150] and len(stack) == 3
    assert free.free_pages == 100
    assert stack.refill()  # a large run gives its first REFILL_PAGES pages
    assert len(stack) == 3 + REFILL_PAGES and stack.pages[-1] == 0
    assert list(free.runs()) == [(REFILL_PAGES, 100 - REFILL_PAGES)]


def test_a_refill_with_nothing_free_fails_and_changes_nothing() -> None:
    _, stack = loose()
    assert not stack.refill()
    assert stack.pages == [] and stack.handed_out == 0


def test_take_refills_as_needed_and_counts_one_allocation() -> None:
    free, stack = loose()
    for start in (0, 10, 20):
        free.give_now(start, 2)
    assert sorted(stack.take(5)) == [0, 1, 10, 11, 20]  # the runs filed last go first
    assert stack.pages == [21] and stack.handed_out == 1
    assert free.free_pages == 0


def test_take_beyond_what_is_free_is_a_corruption() -> None:
    free, stack = loose()
    free.give_now(0, 2)
    with pytest.raises(PoolCorrupted, match="free pages are miscounted"):
        stack.take(3)


def test_pages_popped_one_by_one_count_as_handed_out_and_settle_files_the_rest() -> None:
    free, stack = loose()
    free.give_now(0, 4)
    free.give_now(6, 4)
    stack.refill()
    assert stack.pages == [9, 8, 7, 6]
    assert stack.pages.pop() == 6  # what `PagePool.append` does inline, without a call
    assert stack.pages.pop() == 7
    assert stack.handed_out == 2
    stack.give_back([7, 6])  # a table that ends returns its loose pages
    assert stack.handed_out == 2
    stack.settle()
    assert stack.pages == [] and stack.handed_out == 2
    assert list(free.runs()) == [(0, 4), (6, 4)]


# ---- the pool's allocation count ----------------------------------------------------------


def test_every_way_of_getting_pages_counts_one_allocation() -> None:
    p = PagePool(64, 4, segment_pages=64, reserve_pages=8)
    p.allocate("a", 4)  # a run, on the fast path
    assert p.alloc_attempts == 1
    p.append("a", 4)  # a run after the last page, with a reservation
    assert (p.alloc_attempts, p.reserved_pages) == (2, 7)
    p.append("a", 4)  # a reserved page, on the fast path
    assert (p.alloc_attempts, p.reserved_pages) == (3, 6)
    p.append("a", 8)  # two pages at once, from the reservation's run
    assert p.alloc_attempts == 4
    with pytest.raises(PoolExhausted):
        p.allocate("b", 4 * 100)  # a failure counts too
    assert (p.alloc_attempts, p.alloc_failures) == (5, 1)
    assert p.stats().alloc_attempts_total == 5
    p.invariants.check()


def test_loose_pages_count_one_allocation_each_time_they_serve_one() -> None:
    p = PagePool(16, 1, segment_pages=16)
    for i in range(16):
        p.allocate(i, 1)
    for i in range(0, 16, 2):
        p.free(i)  # free: 0 2 4 ... 14, no two adjacent
    p.allocate("x", 3)  # no run of 3: three loose pages, one allocation
    assert p.alloc_attempts == 17
    p.append("x", 1)  # one loose page, on the fast path
    p.append("x", 1)
    assert p.alloc_attempts == 19 and p.table("x").loose_from == 0
    p.free("x")  # its five pages go back loose
    assert len(p._loose) == 5
    p.allocate("y", 2)  # no run of 2: two loose pages, one allocation
    p.append("y", 1)  # one more, on the fast path
    assert p.alloc_attempts == 21 and len(p._loose) == 2
    p.free("y")
    p.stats()  # files the loose pages back into the runs: no allocation
    assert p.alloc_attempts == 21 and len(p._loose) == 0
    p.invariants.check()


# ---- the parts the pool lends, on its own arrays -------------------------------------------


def test_the_parts_read_and_move_the_pages_a_grow_adds_and_a_truncate_drops() -> None:
    """Sizing grows and truncates the very lists the other parts read: pages a grow adds can
    be held, moved and read through them, and after a truncate they are gone for all."""
    p = PagePool(8, 1, segment_pages=8)
    p.sizing.grow(8)
    p.allocate("a", 12)  # pages 0..11, across the grown segment
    p.holds.hold(list(range(8, 12)))
    p.free("a")  # 0..7 free, 8..11 cached
    assert (p.holds.held, p.cached_pages, p.pages.refcount(8)) == (4, 4, 0)
    p.relocation.relocate([(8, 0), (9, 1), (10, 2), (11, 3)])
    assert p.pages.map() == [PageRun(PageState.CACHED, 0, 4), PageRun(PageState.FREE, 4, 12)]
    assert p.sizing.occupied_above(8) == 0
    p.sizing.truncate(8)
    assert (p.capacity, p.sizing.segments, p.pages.states().capacity) == (8, 1, 8)
    assert p.pages.free_runs() == [(4, 4)]
    p.invariants.check()
    p.holds.release([0, 1, 2, 3])
    assert (p.free_pages, p.holds.held) == (8, 0)
    p.invariants.check()


# ---- the invariant check, one broken piece at a time --------------------------------------


def grown_pool() -> PagePool:
    """A with pages [0, 1] and seven reserved after them ([2..8]); b with [9, 10]; page 11 on
    is free."""
    p = PagePool(64, 4, segment_pages=64, reserve_pages=8)
    p.allocate("a", 4)
    p.append("a", 4)
    p.allocate("b", 8)
    assert p.table("b").pages == [9, 10] and p.table("a").reserved == 7
    p.invariants.check()
    return p


def forked_pool() -> PagePool:
    """A with pages [0, 1]; b its fork, sharing both."""
    p = PagePool(64, 4, segment_pages=64)
    p.allocate("a", 8)
    p.fork("a", "b")
    p.invariants.check()
    return p


def loose_pool() -> PagePool:
    """Sixteen one-page pools' worth of shreds, three pages of them loose."""
    p = PagePool(16, 1, segment_pages=16)
    for i in range(16):
        p.allocate(i, 1)
    for i in range(0, 16, 2):
        p.free(i)
    p.allocate("x", 3)
    p.free("x")
    assert len(p._loose) == 3
    p.invariants.check()
    return p


def full_pool() -> PagePool:
    p = PagePool(64, 4, segment_pages=64)
    p.allocate("a", 4 * 64)
    p.invariants.check()
    return p


def _swap_first_pages(p: PagePool) -> None:
    t = p.table("b")
    t.pages[0], t.pages[1] = t.pages[1], t.pages[0]


def _beyond_the_pool(p: PagePool) -> None:
    t = p.table("b")
    t.private = t.writable = False  # False is always safe: only the page is wrong
    t.pages[-1] = p.capacity + 3


def _touching_runs(p: PagePool) -> None:
    p._free.take_range(30, 1)
    p._free._insert(30, 1)  # filed without merging: [11, 30) [30, 31) [31, 64)


BREAKS: dict[str, tuple[Callable[[], PagePool], Callable[[PagePool], object], str]] = {
    # the pool-wide parts
    "loose twice": (loose_pool, lambda p: p._loose.pages.append(p._loose.pages[0]), "loose twice"),
    "beyond the pool": (grown_pool, _beyond_the_pool, "beyond the pool"),
    "reserved and held": (
        grown_pool,
        lambda p: p._cached.__setitem__(5, 1),
        "reserved page 5 is also held",
    ),
    "reference count": (grown_pool, lambda p: p._ref.__setitem__(40, 1), "reference counts"),
    "owner": (grown_pool, lambda p: p._owner.__setitem__(9, p.table("a")), "wrong table"),
    "sharers": (forked_pool, lambda p: p._sharers[0].pop(), "sharers differ"),
    "shared alone": (
        grown_pool,
        lambda p: p._sharers.__setitem__(40, [p.table("a")]),
        "fewer than two",
    ),
    "reserved count": (grown_pool, lambda p: setattr(p._reservations, "pages", 8), "reservations"),
    "reserving tables": (grown_pool, lambda p: p._reservations.tables.clear(), "reservations"),
    "free runs touch": (grown_pool, _touching_runs, "touch at page 30"),
    "free run past the end": (full_pool, lambda p: p._free._insert(64, 2), "past the capacity"),
    "free and held": (
        grown_pool,
        lambda p: p._free._insert(0, 1),
        "page 0 is free and held, or neither",
    ),
    "neither free nor held": (
        grown_pool,
        lambda p: p._free.take_range(60, 4),
        "page 60 is free and held, or neither",
    ),
    "cache holds": (grown_pool, lambda p: setattr(p.holds, "held", 1), "cache-held pages"),
    "cached count": (grown_pool, lambda p: setattr(p, "cached_pages", 1), "counted as cached"),
    "free count": (
        grown_pool,
        lambda p: setattr(p._free, "free_pages", p._free.free_pages + 1),
        "free \\+ used \\+ cached != capacity",
    ),
    # the parts about one table
    "page twice": (
        grown_pool,
        lambda p: p.table("b").pages.__setitem__(1, 9),
        "holds a page twice",
    ),
    "tokens": (grown_pool, lambda p: setattr(p.table("b"), "num_tokens", 20), "match its tokens"),
    "room": (grown_pool, lambda p: setattr(p.table("b"), "room", 9), "room is miscounted"),
    "writable": (forked_pool, lambda p: setattr(p.table("b"), "writable", True), "marked writable"),
    "private": (forked_pool, lambda p: setattr(p.table("b"), "private", True), "marked private"),
    "run starts": (grown_pool, lambda p: setattr(p.table("b"), "run_starts", (1,)), "out of order"),
    "run": (grown_pool, _swap_first_pages, "not contiguous"),
    "reservation place": (
        grown_pool,
        lambda p: setattr(p.table("a"), "reserve_next", 3),
        "does not follow its last page",
    ),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_the_check_catches_each_broken_piece_of_bookkeeping(name: str) -> None:
    build, corrupt, message = BREAKS[name]
    p = build()
    corrupt(p)
    with pytest.raises(PoolCorrupted, match=message):
        p.invariants.check()
