"""PoolResizer: grow, shrink with evacuation, and refusals that change nothing."""

import pytest

from kvctl.agent.pool import Defragmenter, PagePool, PoolResizer, ResizeRefused


class CountingStore:
    def __init__(self, segments: int) -> None:
        self.segments = segments

    def add_segments(self, count: int) -> None:
        self.segments += count

    def release_segments(self, count: int) -> None:
        self.segments -= count


def setup(pages: int = 12) -> tuple[PagePool, PoolResizer, CountingStore]:
    pool = PagePool(pages, 4, segment_pages=4)
    store = CountingStore(pool.sizing.segments)
    return pool, PoolResizer(pool, Defragmenter(pool), store, max_pages=32), store


def test_grow_adds_whole_segments_as_one_free_run_at_the_top() -> None:
    pool, resizer, store = setup()
    pool.allocate("a", 40)  # [0..9]
    result = resizer.resize(18)  # rounded up to 20 pages
    assert (result.old_pages, result.new_pages, result.direction) == (12, 20, "grow")
    assert pool.pages.free_runs() == [(10, 10)]
    assert store.segments == 5
    pool.invariants.check()


def test_shrink_evacuates_the_tail_then_releases_it() -> None:
    pool, resizer, store = setup()
    pool.allocate("a", 16)  # [0..3]
    pool.allocate("b", 16)  # [4..7]
    pool.allocate("c", 8)  # [8, 9]
    pool.free("a")
    result = resizer.resize(8)
    assert (result.new_pages, result.pages_moved) == (8, 2)
    assert pool.table("c").pages == [0, 1]
    assert pool.table("b").pages == [4, 5, 6, 7]
    assert (pool.capacity, store.segments) == (8, 2)
    assert pool.pages.free_runs() == [(2, 2)]
    pool.invariants.check()


def test_refused_shrink_leaves_everything_as_it_was() -> None:
    pool, resizer, store = setup()
    pool.allocate("a", 16)
    pool.allocate("b", 12)
    pool.free("a")
    pool.allocate("c", 8)  # 5 pages in use: b=[4,5,6] c=[0,1]
    before = (pool.capacity, pool.pages.free_runs(), pool.table("b").pages, pool.table("c").pages)
    with pytest.raises(ResizeRefused, match="5 pages in use above the new size 4"):
        resizer.resize(4)
    after = (pool.capacity, pool.pages.free_runs(), pool.table("b").pages, pool.table("c").pages)
    assert after == before
    assert store.segments == 3
    with pytest.raises(ResizeRefused, match="maximum of 32"):
        resizer.resize(40)
    with pytest.raises(ResizeRefused, match="smaller than 4"):
        resizer.resize(0)
    assert pool.capacity == 12
    pool.invariants.check()


def test_a_refusal_names_the_pages_asked_and_the_rounding() -> None:
    """`--pages 5000` used to be refused as "5120 pages is above the maximum", a number the
    operator never typed."""
    _, resizer, _ = setup()
    with pytest.raises(ResizeRefused) as refused:
        resizer.resize(33)
    assert str(refused.value).startswith(
        "33 pages (rounded up to 36, whole segments of 4 pages) is above the maximum of 32 pages"
    )
    with pytest.raises(ResizeRefused, match=r"^40 pages is above the maximum of 32 pages"):
        resizer.resize(40)


def test_shrink_refuses_when_cached_pages_cannot_be_evicted() -> None:
    pool, resizer, _ = setup()
    pool.allocate("a", 40)
    pool.holds.hold(list(range(10)))
    pool.free("a")
    with pytest.raises(ResizeRefused, match="nothing can evict"):
        resizer.resize(4)
    assert (pool.capacity, pool.cached_pages) == (12, 10)


def test_shrink_evicts_cached_pages_that_do_not_fit() -> None:
    pool, resizer, _ = setup()
    pool.allocate("a", 40)  # [0..9]
    pool.holds.hold(list(range(10)))
    pool.free("a")
    order = list(range(9, -1, -1))

    def evict(n: int, reason: str = "allocation") -> int:
        victims, order[:] = order[:n], order[n:]
        pool.holds.release(victims)
        return len(victims)

    pool.set_evictor(evict)
    result = resizer.resize(4)
    assert (result.new_pages, result.pages_evicted) == (4, 6)
    assert [pool.pages.state(p).value for p in range(4)] == ["cached"] * 4
    pool.invariants.check()
