"""PagePool scenarios on tiny pools, with the exact page ids expected after each step."""

import pytest

from kvctl.agent.pool import PagePool, PageState, PoolError, PoolExhausted, UnknownSequence
from kvctl.agent.pool.stats import PageRun


def pool(pages: int = 12, page_size: int = 4, segment_pages: int = 4) -> PagePool:
    return PagePool(pages, page_size, segment_pages, bytes_per_page=100)


def test_allocate_prefers_one_contiguous_run() -> None:
    p = pool()
    assert p.allocate("a", 10).pages == [0, 1, 2]  # 10 tokens / 4 per page
    assert p.allocate("b", 4).pages == [3]
    assert p.allocate("c", 8).pages == [4, 5]
    p.free("b")
    # the freed single page is the best fit for a one-page request
    assert p.allocate("d", 1).pages == [3]
    assert p.pages.free_runs() == [(6, 6)]
    p.invariants.check()


def test_allocation_falls_back_to_scattered_pages_and_counts_the_miss() -> None:
    p = pool()
    for name in "abcdef":
        p.allocate(name, 8)  # two pages each: a=[0,1] b=[2,3] ... f=[10,11]
    p.free("b")
    p.free("d")
    assert p.pages.free_runs() == [(2, 2), (6, 2)]
    t = p.allocate("g", 16)  # four pages, no run of four is free
    assert sorted(t.pages) == [2, 3, 6, 7]
    assert not t.is_run
    stats = p.stats()
    counts = (stats.contiguous_misses_total, stats.alloc_attempts_total, stats.alloc_failures_total)
    assert counts == (1, 7, 0)
    p.invariants.check()


def test_exhaustion_raises_counts_a_failure_and_changes_nothing() -> None:
    p = pool()
    p.allocate("a", 40)
    with pytest.raises(PoolExhausted, match="need 3 pages, 2 free"):
        p.allocate("b", 12)
    assert "b" not in p
    assert p.pages.free_runs() == [(10, 2)]
    assert (p.alloc_attempts, p.alloc_failures) == (2, 1)
    with pytest.raises(PoolExhausted):
        p.append("a", 12)
    assert p.table("a").num_tokens == 40
    p.invariants.check()


def test_append_fills_the_last_page_before_taking_a_new_one() -> None:
    p = pool()
    p.allocate("a", 3)
    assert p.append("a", 1) == []
    assert p.table("a").pages == [0]
    p.append("a", 1)  # token 5 needs a second page
    assert p.table("a").pages == [0, 1]
    assert p.table("a").is_run
    p.invariants.check()


def test_fork_shares_pages_and_append_copies_a_shared_partial_page() -> None:
    p = pool()
    p.allocate("a", 6)  # pages [0, 1]; page 1 holds 2 of 4 tokens
    p.fork("a", "b")
    assert p.table("b").pages == [0, 1]
    assert (p.pages.refcount(0), p.pages.refcount(1)) == (2, 2)
    copies = p.append("b", 1)
    assert [(c.src, c.dst) for c in copies] == [(1, 2)]
    assert p.table("b").pages == [0, 2]
    assert (p.pages.refcount(1), p.pages.refcount(2)) == (1, 1)
    assert p.append("a", 1) == []  # page 1 is private to "a" again: no copy
    p.free("a")
    assert p.pages.free_runs() == [(1, 1), (3, 9)]
    p.free("b")
    assert p.pages.free_runs() == [(0, 12)]
    p.invariants.check()


def test_cached_pages_outlive_their_sequence_until_released() -> None:
    p = pool()
    p.allocate("a", 8)  # [0, 1]
    p.holds.hold([0, 1])
    p.free("a")
    assert [p.pages.state(0), p.pages.state(1), p.pages.state(2)] == [
        PageState.CACHED,
        PageState.CACHED,
        PageState.FREE,
    ]
    assert (p.used_pages, p.cached_pages, p.free_pages) == (0, 2, 10)
    table, copies = p.adopt("b", [0, 1], shared_tokens=6, num_tokens=7)
    # page 1 is held by the cache and only partly matched: "b" writes into a private copy
    assert [(c.src, c.dst) for c in copies] == [(1, 2)]
    assert table.pages == [0, 2]
    assert (p.used_pages, p.cached_pages) == (2, 1)
    p.holds.release([0, 1])
    assert p.pages.free_runs() == [(1, 1), (3, 9)]
    p.invariants.check()


def test_allocation_evicts_cached_pages_when_short() -> None:
    p = pool(pages=4, segment_pages=4)
    p.allocate("a", 16)
    p.holds.hold([0, 1, 2, 3])
    p.free("a")

    def evict(n: int, reason: str = "allocation") -> int:
        p.holds.release([3, 2][:n] if n <= 2 else [3, 2, 1, 0][:n])
        return n

    p.set_evictor(evict)
    assert p.can_allocate(8)
    assert p.allocate("b", 8).pages == [2, 3]
    assert p.cached_pages == 2
    p.invariants.check()


def test_page_map_is_run_length_encoded() -> None:
    p = pool()
    p.allocate("a", 8)  # [0, 1]
    p.allocate("b", 4)  # [2]
    p.holds.hold([2])
    p.free("b")
    assert p.pages.map() == [
        PageRun(PageState.USED, 0, 2),
        PageRun(PageState.CACHED, 2, 1),
        PageRun(PageState.FREE, 3, 9),
    ]


def test_stats_follow_the_design_definitions() -> None:
    p = pool()
    for name in "abcdef":
        p.allocate(name, 8)
    p.free("b")  # frees [2, 3]
    p.free("e")  # frees [8, 9]
    p.free("f")  # frees [10, 11] -> run [8, 12)
    s = p.stats()
    assert (s.free_pages, s.free_extents, s.largest_free_run) == (6, 2, 4)
    assert s.fragmentation_ratio == pytest.approx(1 - 4 / 6)
    assert s.utilization_ratio == pytest.approx(6 / 12)
    assert (s.capacity_bytes, s.used_bytes) == (1200, 600)
    assert pool().stats().fragmentation_ratio == 0.0
    full = pool()
    full.allocate("x", 48)
    assert full.stats().fragmentation_ratio == 0.0  # nothing free


def test_bad_calls_are_refused() -> None:
    p = pool()
    p.allocate("a", 1)
    with pytest.raises(PoolError, match="already has a page table"):
        p.allocate("a", 1)
    with pytest.raises(UnknownSequence, match="'zz' is not in the pool"):
        p.free("zz")
    with pytest.raises(ValueError):
        p.allocate("b", -1)
    with pytest.raises(PoolError, match="is free"):
        p.holds.hold([5])
    p.invariants.check()


def test_growth_reserves_the_pages_after_the_last_one_and_stays_a_run() -> None:
    p = PagePool(1024, 4, segment_pages=1024, reserve_pages=8)
    p.allocate("a", 4)  # [0]
    p.allocate("b", 4)  # [1]: "a" cannot extend in place
    p.append("a", 4)  # a new run of 8 for "a": one page used, seven reserved after it
    a = p.table("a")
    assert a.pages == [0, 2] and a.reserved == 7
    for _ in range(7):  # the reserved pages follow, one by one
        p.append("a", 4)
    assert a.pages == [0, *range(2, 10)] and a.reserved == 0
    assert a.run_starts == [0, 1]  # two runs: [0] and [2..9]
    assert (p.free_pages, p.used_pages, p.reserved_pages) == (1014, 10, 0)
    p.invariants.check()
    p.free("a")
    assert p.pages.free_runs() == [(0, 1), (2, 1022)]
    p.invariants.check()


def test_reserved_pages_count_as_free_and_are_reclaimed_before_a_failure() -> None:
    p = PagePool(64, 4, segment_pages=64, reserve_pages=8)
    p.allocate("a", 4)
    p.append("a", 4)  # [0, 1] and 7 reserved: [2..8]
    assert (p.reserved_pages, p.free_pages) == (7, 62)
    p.allocate("big", 4 * 62)  # needs every free page: the reservation is given back first
    assert p.reserved_pages == 0 and p.free_pages == 0
    assert p.stats().alloc_failures_total == 0
    p.invariants.check()


def test_shredded_free_space_is_handed_out_loose_and_filed_back_on_a_read() -> None:
    p = PagePool(16, 1, segment_pages=16)
    for i in range(16):
        p.allocate(i, 1)
    for i in range(0, 16, 2):
        p.free(i)  # free: 0 2 4 ... 14, no two adjacent
    t = p.allocate("x", 3)  # no run of 3: three loose pages
    assert not t.is_run and t.loose_from == 0 and len(set(t.pages)) == 3
    assert p.stats().contiguous_misses_total == 1
    p.free("x")  # back loose, counted free
    assert p.free_pages == 8
    assert p.stats().free_extents == 8  # a read files them into the free runs
    assert p._loose.pages == []
    p.invariants.check()


def test_a_move_rewrites_only_the_tables_that_hold_the_moved_pages() -> None:
    p = PagePool(12, 4, segment_pages=4)
    for name in "abcdef":
        p.allocate(name, 8)  # two pages each
    p.fork("e", "e2")  # e's pages have two holders
    tables = {name: p.table(name) for name in ("a", "c", "e", "e2", "f")}
    p.free("b")
    p.relocation.relocate([(8, 2), (9, 3)])  # e's pages, shared with e2
    assert tables["e"].pages == tables["e2"].pages == [2, 3]
    assert (p.pages.refcount(2), p.pages.refcount(8)) == (2, 0)
    assert tables["a"].pages == [0, 1] and tables["f"].pages == [10, 11]
    p.free("e")
    p.free("e2")
    p.invariants.check()


def test_a_cached_run_is_held_shared_and_released_whole() -> None:
    """The slice paths: holding a run, a prefix hit on a run only the cache holds, freeing it,
    and releasing the run while some of it is in use again."""
    p = PagePool(64, 4, segment_pages=64)
    p.allocate("a", 32)  # [0..7]
    p.holds.hold(p.table("a").pages)
    assert not p.table("a").private and p.cached_pages == 0
    p.free("a")
    assert (p.cached_pages, p.used_pages) == (8, 0)
    table, copies = p.adopt("b", list(range(8)), 32, 36)  # all eight cached pages, one more
    assert copies == [] and table.pages[:8] == list(range(8))
    assert (p.cached_pages, p.used_pages) == (0, 9)
    p.invariants.check()
    p.free("b")  # the shared run goes back to the cache, the private page to the free space
    assert (p.cached_pages, p.used_pages, p.free_pages) == (8, 0, 56)
    p.invariants.check()
    p.adopt("c", list(range(4)), 16, 16)  # uses half of the run again
    p.holds.release(list(range(8)))  # the used half stays used, the rest is free
    assert (p.cached_pages, p.used_pages, p.free_pages) == (0, 4, 60)
    p.invariants.check()
    with pytest.raises(PoolError, match="not all held"):
        p.holds.release(list(range(4, 8)))  # no longer held: refused, nothing changed
    assert p.free_pages == 60
    p.invariants.check()


def test_holding_pages_of_a_freed_table_never_trusts_its_stale_flags() -> None:
    p = PagePool(64, 4, segment_pages=64)
    p.allocate("a", 32)  # [0..7]
    p.free("a")  # "a" is gone; its table object still says private, pages [0..7]
    p.allocate("b", 16)  # [0..3] again, owned by "b"
    with pytest.raises(PoolError, match="free"):
        p.holds.hold(list(range(8)))  # pages 4..7 are free
    with pytest.raises(PoolError, match="not held"):
        p.holds.release([0])  # the refused hold changed nothing
    p.holds.hold(list(range(4)))
    assert p.cached_pages == 0 and not p.table("b").private
    p.invariants.check()
