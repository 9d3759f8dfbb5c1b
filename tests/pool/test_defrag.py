"""Defragmenter and AutoDefrag scenarios with exact moves and exact resulting page tables."""

import pytest

from kvctl.agent.pool import (
    AutoDefrag,
    Defragmenter,
    DefragTrigger,
    PagePool,
    moves_needed,
    plan_moves,
)
from kvctl.settings import DefragSettings


class RecordingCopier:
    """Holds one value per page so a test can see contents follow their pages."""

    def __init__(self, pages: int) -> None:
        self.contents = [None] * pages
        self.batches: list[tuple[list[int], list[int]]] = []

    def copy_pages(self, src, dst) -> None:
        self.batches.append((list(src), list(dst)))
        values = [self.contents[s] for s in src]
        for d, v in zip(dst, values, strict=True):
            self.contents[d] = v


def fragmented() -> PagePool:
    """12 pages of 4 tokens: a=[0,1] c=[4,5] e=[8,9] f=[10,11]; free [2,3] and [6,7]."""
    p = PagePool(12, 4, segment_pages=4, bytes_per_page=10)
    for name in "abcdef":
        p.allocate(name, 8)
    p.free("b")
    p.free("d")
    return p


def test_plan_moves_highest_sources_into_lowest_holes_in_page_order() -> None:
    p = fragmented()
    assert moves_needed(p) == 4
    # every hole is below every source, so sources ascend with holes: a run lands as a run
    assert plan_moves(p, 10) == [(8, 2), (9, 3), (10, 6), (11, 7)]
    assert plan_moves(p, 3) == [(9, 2), (10, 3), (11, 6)]
    assert plan_moves(p, 10, boundary=10) == [(10, 2), (11, 3)]
    assert plan_moves(p, 10, boundary=4) == [(10, 2), (11, 3)]  # the only holes below 4


def test_plan_stops_where_a_move_would_go_up() -> None:
    p = PagePool(8, 1, segment_pages=8)
    for name in "abcdefgh":
        p.allocate(name, 1)
    for name in "bdg":
        p.free(name)  # free 1, 3, 6; occupied 0 2 4 5 7
    # 7 -> 1, 5 -> 3; then the next source (4) is below the next hole (6)
    assert plan_moves(p, 10) == [(5, 1), (7, 3)]


def test_full_defrag_compacts_and_contents_follow_their_pages() -> None:
    p = fragmented()
    copier = RecordingCopier(12)
    for name in "acef":
        for i, page in enumerate(p.table(name).pages):
            copier.contents[page] = (name, i)
    report = Defragmenter(p, copier, batch_pages=2).run(DefragTrigger.MANUAL)
    assert copier.batches == [([10, 11], [2, 3]), ([8, 9], [6, 7])]
    assert p.table("f").pages == [2, 3]
    assert p.table("e").pages == [6, 7]
    assert p.table("f").is_run and p.table("e").is_run
    assert p.pages.free_runs() == [(8, 4)]
    for name in "acef":
        assert [copier.contents[pg] for pg in p.table(name).pages] == [(name, 0), (name, 1)]
    assert report.fragmentation_before == pytest.approx(0.5)
    assert (report.fragmentation_after, report.pages_moved, report.bytes_moved) == (0.0, 4, 40)
    assert (report.free_extents_before, report.free_extents_after, report.complete) == (2, 1, True)
    p.invariants.check()


def test_budgeted_run_stops_early_and_resumes() -> None:
    p = fragmented()
    d = Defragmenter(p, batch_pages=1)
    first = d.run(DefragTrigger.THRESHOLD, max_pages=3)
    assert (first.pages_moved, first.complete) == (3, False)
    second = d.run(DefragTrigger.THRESHOLD, max_pages=3)
    assert (second.pages_moved, second.complete) == (1, True)
    assert p.stats().fragmentation_ratio == 0.0


def test_time_budget_is_read_from_the_injected_clock() -> None:
    p = fragmented()
    ticks = iter(range(100))
    d = Defragmenter(p, batch_pages=1, clock=lambda: float(next(ticks)))
    report = d.run(DefragTrigger.MANUAL, max_seconds=2.0)
    assert report.pages_moved == 2  # one page per clock tick, stopped after two seconds
    assert not report.complete


def test_moves_update_cached_holds_and_listeners() -> None:
    p = fragmented()
    p.holds.hold([10, 11])
    p.free("f")  # pages 10, 11 stay cached
    seen: list[dict[int, int]] = []
    p.relocation.add_listener(seen.append)
    Defragmenter(p).run(DefragTrigger.MANUAL)
    assert seen == [{8: 2, 9: 3, 10: 6, 11: 7}]
    assert [p.pages.state(page).value for page in (2, 3, 6, 7)] == [
        "used",
        "used",
        "cached",
        "cached",
    ]
    assert p.cached_pages == 2
    p.invariants.check()


def test_auto_defrag_threshold_with_hysteresis() -> None:
    p = fragmented()  # fragmentation 0.5 with 4 free pages
    now = [0.0]
    policy = DefragSettings(
        fragmentation_threshold=0.4,
        fragmentation_target=0.1,
        min_free_pages=1,
        check_interval_s=10.0,
        step_max_pages=1,
    )
    auto = AutoDefrag(Defragmenter(p, batch_pages=1), policy, clock=lambda: now[0])
    first = auto.tick()
    assert first is not None and first.trigger == DefragTrigger.THRESHOLD
    assert first.pages_moved == 1
    # the session goes on below the threshold until it reaches the target
    while auto.active is not None:
        assert auto.tick() is not None
    assert p.stats().fragmentation_ratio == 0.0
    assert auto.runs_total == {DefragTrigger.THRESHOLD: 1}
    assert auto.completed[-1].pages_moved == 4
    # compact now, and no check due before the interval: nothing runs
    assert auto.tick() is None


def test_auto_defrag_checks_thresholds_only_every_interval() -> None:
    p = PagePool(12, 4, segment_pages=4)
    now = [0.0]
    policy = DefragSettings(fragmentation_threshold=0.4, min_free_pages=1, check_interval_s=10.0)
    auto = AutoDefrag(Defragmenter(p), policy, clock=lambda: now[0])
    assert auto.tick() is None  # compact pool: checked at t=0, nothing to do
    for name in "abcdef":
        p.allocate(name, 8)
    p.free("b")
    p.free("d")
    now[0] = 5.0
    assert auto.tick() is None  # fragmented, but the next check is at t=10
    now[0] = 10.0
    assert auto.tick() is not None


def test_auto_defrag_starts_on_a_contiguous_miss_and_on_extents() -> None:
    p = fragmented()
    policy = DefragSettings(fragmentation_threshold=1.0, fragmentation_target=1.0, min_free_pages=1)
    auto = AutoDefrag(Defragmenter(p), policy, clock=lambda: 0.0)
    assert auto.tick() is None
    p.allocate("g", 12)  # three pages, no run of three: a contiguous miss
    report = auto.tick()
    assert report is not None and report.trigger == DefragTrigger.ALLOC_FAILURE

    p2 = fragmented()
    policy2 = DefragSettings(
        fragmentation_threshold=1.0, max_free_extents=1, min_free_pages=1, check_interval_s=0.1
    )
    auto2 = AutoDefrag(Defragmenter(p2), policy2, clock=lambda: 0.0)
    report2 = auto2.tick()
    assert report2 is not None and report2.trigger == DefragTrigger.EXTENTS


def test_disabled_auto_defrag_runs_only_when_asked() -> None:
    p = fragmented()
    auto = AutoDefrag(Defragmenter(p), DefragSettings(enabled=False), clock=lambda: 0.0)
    seen = []
    auto.add_listener(seen.append)
    assert auto.tick() is None
    report = auto.run_now(DefragTrigger.MANUAL)
    assert (report.trigger, report.pages_moved, report.complete) == (DefragTrigger.MANUAL, 4, True)
    assert auto.runs_total == {DefragTrigger.MANUAL: 1} and auto.pages_moved_total == 4
    assert seen == [report]


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="fragmentation_target"):
        DefragSettings(fragmentation_threshold=0.2, fragmentation_target=0.5)
    with pytest.raises(ValueError, match="step_max_pages"):
        DefragSettings(step_max_pages=0)


def test_a_full_defrag_of_a_large_churned_pool_leaves_one_free_run() -> None:
    """Thousands of runs filed and merged: the defragmenter must still see every hole (a run
    missing from its heap of free runs once ended a defrag early, reporting it complete)."""
    import random

    rng = random.Random(0)
    pool = PagePool(4096, 16, 1024)
    next_id = 0
    for _ in range(4):
        while pool.used_pages < 0.9 * pool.capacity:
            tokens = rng.randint(1, 32 * 16)
            if not pool.can_allocate(tokens):
                break
            pool.allocate(next_id, tokens)
            next_id += 1
        running = pool.sequences()
        rng.shuffle(running)
        while pool.used_pages > 0.6 * pool.capacity:
            pool.free(running.pop())
    assert pool.stats().fragmentation_ratio > 0.5
    report = Defragmenter(pool, batch_pages=1024).run(DefragTrigger.MANUAL)
    assert report.complete
    assert pool.stats().fragmentation_ratio == 0.0
    assert len(pool.pages.free_runs()) == 1
    pool.invariants.check()
