"""Rebalancer decisions on real pools under one budget, with a fake clock: where memory comes
from, when it may move, what a donor keeps, and the hysteresis that stops pools trading the same
segments back and forth."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

from kvctl.agent.budget import KvBudget, Move, Pressure, Rebalancer
from kvctl.agent.pool import Defragmenter, PagePool, PoolResizer
from kvctl.settings import RebalanceSettings

PAGE_SIZE = 4
CALM = Pressure()

# Pressure and calm count from the first reading; no headroom unless a test asks for it.
SETTINGS = RebalanceSettings(pressure_s=0.0, calm_s=0.0, cooldown_s=10.0, headroom_ratio=0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def short(pages: int) -> Pressure:
    return Pressure(short_pages=pages)


def add(
    budget: KvBudget,
    name: str,
    pages: int,
    segment: int = 4,
    page_bytes: int = 100,
    used: int = 0,
    floor: int | None = None,
    ceiling: int = 64,
    cached: int = 0,
    evictable: bool = True,
    promised: Callable[[], int] | None = None,
) -> PagePool:
    """A pool of `pages` under the budget with `used` pages in use and `cached` pages held only
    by a (fake) prefix cache, evictable unless told otherwise; `promised`: what the engine
    would tell the pool's resizer its admitted requests may need."""
    pool = PagePool(pages, PAGE_SIZE, segment, page_bytes)
    if used:
        pool.allocate("live", used * PAGE_SIZE)
    if cached:
        pool.allocate("done", cached * PAGE_SIZE)
        held = list(pool.table("done").pages)
        pool.holds.hold(held)
        pool.free("done")
        if evictable:

            def evict(n: int, reason: str = "allocation") -> int:
                victims, held[:] = held[:n], held[n:]
                pool.holds.release(victims)
                return len(victims)

            pool.set_evictor(evict)
    resizer = PoolResizer(
        pool,
        Defragmenter(pool),
        min_pages=floor or segment,
        max_pages=ceiling,
        promised=promised,
    )
    budget.add(name, resizer)
    return pool


def rebalancer(budget: KvBudget, clock: Clock, **changes: object) -> Rebalancer:
    return Rebalancer(budget, SETTINGS.model_copy(update=changes), clock)


def capacities(budget: KvBudget) -> dict[str, int]:
    return {name: member.pool.capacity for name, member in budget.pools.items()}


def test_takes_unassigned_budget_before_any_donor() -> None:
    budget = KvBudget(16 * 100 + 16 * 100 + 8 * 100)
    add(budget, "a", 16)
    add(budget, "b", 16)
    clock = Clock()
    rb = rebalancer(budget, clock)
    rb.observe({"a": (short(8), 0), "b": (CALM, 0)})
    assert rb.is_donor("b")
    assert rb.rebalance() == [Move("a", 800, {})]
    assert capacities(budget) == {"a": 24, "b": 16}
    assert budget.unassigned_bytes == 0
    budget.check()


def test_takes_only_what_the_unassigned_budget_lacks_from_a_donor() -> None:
    budget = KvBudget(16 * 100 + 16 * 100 + 4 * 100)  # one of a's segments unassigned
    add(budget, "a", 16)
    add(budget, "b", 16)
    clock = Clock()
    rb = rebalancer(budget, clock)
    rb.observe({"a": (short(8), 0), "b": (CALM, 0)})  # two segments short
    assert rb.rebalance() == [Move("a", 800, {"b": 400})]
    assert capacities(budget) == {"a": 24, "b": 12}
    assert budget.unassigned_bytes == 0
    budget.check()


def test_takes_from_the_donor_with_the_most_reclaimable_bytes_not_pages() -> None:
    budget = KvBudget(8 * 100 + 32 * 100 + 12 * 400)  # full
    add(budget, "a", 8)
    b = add(budget, "b", 32, used=8)  # 24 pages reclaimable = 2400 bytes
    c = add(budget, "c", 12, page_bytes=400)  # 8 pages reclaimable = 3200 bytes
    clock = Clock()
    rb = rebalancer(budget, clock)
    assert rb.reclaimable_pages("b") == 24
    assert rb.reclaimable_pages("c") == 8
    rb.observe({"a": (short(4), 0), "b": (CALM, 0), "c": (CALM, 0)})
    assert rb.rebalance() == [Move("a", 400, {"c": 1600})]
    assert (b.capacity, c.capacity) == (32, 8)
    assert budget.unassigned_bytes == 1200  # c's segment is larger than a's
    budget.check()


def test_the_most_short_taker_is_fed_first() -> None:
    budget = KvBudget(3 * 8 * 100 + 4 * 100)  # one segment unassigned
    add(budget, "a", 8)
    add(budget, "b", 8)
    add(budget, "c", 8, floor=8)  # no donor
    clock = Clock()
    rb = rebalancer(budget, clock)
    rb.observe({"a": (short(1), 0), "b": (short(3), 0), "c": (CALM, 0)})
    assert rb.rebalance() == [Move("b", 400, {})]
    assert capacities(budget) == {"a": 8, "b": 12, "c": 8}


def test_pressure_must_hold_pressure_s_before_a_move() -> None:
    budget = KvBudget(16 * 100 + 4 * 100)
    add(budget, "a", 16)
    clock = Clock()
    rb = rebalancer(budget, clock, pressure_s=1.0)
    rb.observe({"a": (short(4), 0)})
    clock.now = 0.5
    rb.observe({"a": (CALM, 0)})  # the pressure stopped: it counts again from the next one
    clock.now = 0.75
    rb.observe({"a": (short(4), 0)})
    for now in (1.25, 1.74):
        clock.now = now
        rb.observe({"a": (short(4), 0)})
        assert rb.rebalance() == []
    assert budget.pools["a"].pool.capacity == 16
    clock.now = 1.75
    rb.observe({"a": (short(4), 0)})
    assert rb.rebalance() == [Move("a", 400, {})]


def test_a_donor_must_be_calm_for_calm_s() -> None:
    budget = KvBudget(16 * 100 + 16 * 100)  # full: the memory must come from b
    add(budget, "a", 16)
    add(budget, "b", 16)
    clock = Clock()
    rb = rebalancer(budget, clock, calm_s=5.0)
    rb.observe({"a": (short(4), 0), "b": (Pressure(failures=1), 0)})
    for now in (1.0, 3.0, 5.99):
        clock.now = now
        rb.observe({"a": (short(4), 0), "b": (CALM, 0)})  # calm since 1.0
        assert not rb.is_donor("b")
        assert rb.rebalance() == []
    clock.now = 6.0
    rb.observe({"a": (short(4), 0), "b": (CALM, 0)})
    assert rb.is_donor("b")
    assert rb.rebalance() == [Move("a", 400, {"b": 400})]


def test_after_a_move_the_taker_cannot_give_and_the_donor_cannot_take_within_cooldown() -> None:
    budget = KvBudget(16 * 100 + 16 * 100)
    add(budget, "a", 16)
    add(budget, "b", 16)
    clock = Clock()
    rb = rebalancer(budget, clock, cooldown_s=10.0, reclaim_s=3600.0)  # cooldown alone
    rb.observe({"a": (short(4), 0), "b": (CALM, 0)})
    assert rb.rebalance() == [Move("a", 400, {"b": 400})]
    for now in (0.5, 5.0, 9.99):
        clock.now = now
        rb.observe({"a": (CALM, 0), "b": (short(4), 0)})  # the load turned round
        assert not rb.is_donor("a")
        assert rb.reclaimable_pages("a") > 0
        assert rb.rebalance() == []
    assert capacities(budget) == {"a": 20, "b": 12}
    clock.now = 10.0
    rb.observe({"a": (CALM, 0), "b": (short(4), 0)})
    assert rb.rebalance() == [Move("b", 400, {"a": 400})]
    assert capacities(budget) == {"a": 16, "b": 16}


def test_a_donor_in_cooldown_cannot_take_even_unassigned_budget() -> None:
    budget = KvBudget(16 * 100 + 16 * 100 + 8 * 100)
    add(budget, "a", 16)
    b = add(budget, "b", 16)
    clock = Clock()
    rb = rebalancer(budget, clock, cooldown_s=10.0)
    rb.observe({"a": (short(20), 0), "b": (CALM, 0)})  # more than the unassigned budget
    assert rb.rebalance() == [Move("a", 2000, {"b": 1200})]
    clock.now = 1.0
    budget.pools["a"].resizer.resize(28)  # an operator gives 8 pages back to the budget
    rb.observe({"a": (CALM, 0), "b": (short(4), 0)})
    assert budget.unassigned_bytes == 800
    assert rb.rebalance() == []
    assert b.capacity == 4


def _alternate(cooldown_s: float, seconds: float = 600.0) -> list[Move]:
    """Two pools whose demand swaps every 4 s, checked every 0.5 s: each reports the pages its
    demand lacks as pressure."""
    budget = KvBudget(2 * 32 * 100)
    pools = {"a": add(budget, "a", 32), "b": add(budget, "b", 32)}
    clock = Clock()
    rb = rebalancer(budget, clock, pressure_s=1.0, calm_s=1.0, cooldown_s=cooldown_s)
    moves: list[Move] = []
    for step in range(int(seconds * 2)):
        clock.now = step * 0.5
        busy = "a" if int(clock.now // 4) % 2 == 0 else "b"
        demand = {name: 48 if name == busy else 8 for name in pools}
        rb.observe({n: (short(max(0, demand[n] - p.capacity)), 0) for n, p in pools.items()})
        moves.extend(rb.rebalance())
        budget.check()
    return moves


def _reversals(moves: list[Move]) -> int:
    return sum(1 for before, after in pairwise(moves) if before.taker != after.taker)


def test_alternating_load_does_not_ping_pong_segments() -> None:
    moves = _alternate(cooldown_s=30.0)
    assert moves, "the loaded pool never got memory"
    assert {move.taker for move in moves} == {"a", "b"}
    # one turn of direction per cooldown at most, and each turn moves at most what a pool can
    # give (28 of its 32 pages, 7 segments), one segment or more per move
    assert _reversals(moves) <= 600 / 30 + 1
    assert len(moves) <= (_reversals(moves) + 1) * 7
    # the bound means something: without the cooldown the segments follow every swap
    assert _reversals(_alternate(cooldown_s=0.0)) > 600 / 30 + 1


def test_pinned_pools_neither_give_nor_take() -> None:
    budget = KvBudget(16 * 100 + 16 * 100 + 16 * 100 + 4 * 100)
    add(budget, "a", 16)
    add(budget, "b", 16)
    add(budget, "c", 16)
    clock = Clock()
    rb = rebalancer(budget, clock)
    budget.pools["a"].pinned = True  # pressured, with budget unassigned
    budget.pools["b"].pinned = True  # calm, with memory to give
    rb.observe({"a": (short(12), 0), "b": (CALM, 0), "c": (CALM, 0)})
    assert not rb.is_donor("b")
    assert rb.is_donor("c")
    assert rb.rebalance() == []
    assert capacities(budget) == {"a": 16, "b": 16, "c": 16}
    # c takes the unassigned segment; a is not calm and b is pinned, so nothing more
    rb.observe({"a": (short(12), 0), "b": (CALM, 0), "c": (short(12), 0)})
    assert rb.rebalance() == [Move("c", 400, {})]
    assert capacities(budget) == {"a": 16, "b": 16, "c": 20}
    budget.pools["a"].pinned = budget.pools["b"].pinned = False
    clock.now = 1.0
    rb.observe({"a": (short(12), 0), "b": (CALM, 0), "c": (CALM, 0)})
    assert rb.rebalance() == [Move("a", 1200, {"b": 1200})]


def test_a_donor_keeps_used_pages_headroom_promised_pages_and_its_floor() -> None:
    budget = KvBudget(8 * 100 + 40 * 100 + 40 * 100 + 40 * 100)  # full
    add(budget, "a", 8, ceiling=200)
    b = add(budget, "b", 40, used=10)  # keeps 10 + 5 headroom: 16 pages
    c = add(budget, "c", 40, used=2, floor=20)  # keeps its floor: 20 pages
    d = add(budget, "d", 40, used=2)  # keeps what its admitted requests may need: 28 pages
    clock = Clock()
    rb = rebalancer(budget, clock, headroom_ratio=0.5)
    rb.observe({"a": (short(200), 0), "b": (CALM, 0), "c": (CALM, 0), "d": (CALM, 26)})
    assert [rb.reclaimable_pages(name) for name in "bcd"] == [24, 20, 12]
    (move,) = rb.rebalance()
    assert move == Move("a", 5600, {"b": 2400, "c": 2000, "d": 1200})
    assert (b.capacity, c.capacity, d.capacity) == (16, 20, 28)
    assert (b.used_pages, c.used_pages, d.used_pages) == (10, 2, 2)
    assert [rb.reclaimable_pages(name) for name in "bcd"] == [0, 0, 0]
    budget.check()


def test_a_donor_gives_its_cached_pages() -> None:
    budget = KvBudget(8 * 100 + 16 * 100)
    add(budget, "a", 8)
    b = add(budget, "b", 16, used=2, cached=10)
    clock = Clock()
    rb = rebalancer(budget, clock)
    rb.observe({"a": (short(12), 0), "b": (CALM, 0)})
    assert rb.rebalance() == [Move("a", 1200, {"b": 1200})]
    assert (b.capacity, b.used_pages, b.cached_pages) == (4, 2, 2)
    b.invariants.check()


def test_a_taker_at_its_ceiling_takes_nothing_and_below_it_takes_up_to_it() -> None:
    budget = KvBudget(16 * 100 + 16 * 100 + 16 * 100)
    add(budget, "a", 16, ceiling=16)
    add(budget, "b", 16, ceiling=20)
    clock = Clock()
    rb = rebalancer(budget, clock)
    rb.observe({"a": (short(8), 0), "b": (short(12), 0)})
    assert rb.rebalance() == [Move("b", 400, {})]
    assert capacities(budget) == {"a": 16, "b": 20}
    assert rb.rebalance() == []
    assert budget.unassigned_bytes == 1200


def test_a_large_segment_is_gathered_from_two_donors() -> None:
    # a's segment: 8 pages x 1000 = 8000 bytes; b gives at most 4 x 1024 = 4096, c 3 x 1500
    budget = KvBudget(8 * 1000 + 8 * 1024 + 6 * 1500)
    a = add(budget, "a", 8, segment=8, page_bytes=1000)
    b = add(budget, "b", 8, segment=4, page_bytes=1024, used=4)
    c = add(budget, "c", 6, segment=3, page_bytes=1500, used=3)
    clock = Clock()
    rb = rebalancer(budget, clock)
    rb.observe({"a": (short(1), 0), "b": (CALM, 0), "c": (CALM, 0)})
    assert max(rb.reclaimable_pages("b") * 1024, rb.reclaimable_pages("c") * 1500) < 8000
    assert rb.rebalance() == [Move("a", 8000, {"c": 4500, "b": 4096})]
    assert (a.capacity, b.capacity, c.capacity) == (16, 4, 3)
    assert budget.unassigned_bytes == 4096 + 4500 - 8000
    budget.check()


def test_no_donor_gives_when_all_of_them_cannot_make_one_segment_of_the_taker() -> None:
    budget = KvBudget(8 * 1000 + 8 * 1024 + 6 * 1500)
    add(budget, "a", 8, segment=8, page_bytes=1000)
    add(budget, "b", 8, segment=4, page_bytes=1024, used=5)  # nothing reclaimable
    add(budget, "c", 6, segment=3, page_bytes=1500, used=3)  # 4500 bytes
    clock = Clock()
    rb = rebalancer(budget, clock)
    rb.observe({"a": (short(1), 0), "b": (CALM, 0), "c": (CALM, 0)})
    assert rb.rebalance() == []
    assert capacities(budget) == {"a": 8, "b": 8, "c": 6}
    assert all(not seen.moves for seen in rb.history.values())


def test_a_donor_that_cannot_give_is_passed_over_for_the_next() -> None:
    """b's cached pages cannot be evicted (no prefix cache evictor), so it cannot shrink below
    them: the memory comes from c, and b is not charged a move."""
    budget = KvBudget(8 * 100 + 24 * 100 + 16 * 100)
    add(budget, "a", 8)
    b = add(budget, "b", 24, cached=22, evictable=False)
    c = add(budget, "c", 16)
    clock = Clock()
    rb = rebalancer(budget, clock)
    rb.observe({"a": (short(4), 0), "b": (CALM, 0), "c": (CALM, 0)})
    assert rb.rebalance() == [Move("a", 400, {"c": 400})]
    assert (b.capacity, c.capacity) == (24, 12)
    assert not rb.history["b"].moves


def test_no_donor_gives_for_a_taker_that_then_gets_nothing() -> None:
    """b cannot give (cached pages nothing evicts) and c alone has half of a's segment: c must
    keep its memory, not shrink for a grow that cannot happen."""
    budget = KvBudget(8 * 100 + 24 * 100 + 8 * 100)
    a = add(budget, "a", 8, segment=8)
    b = add(budget, "b", 24, cached=22, evictable=False)
    c = add(budget, "c", 8, used=4)
    clock = Clock()
    rb = rebalancer(budget, clock)
    rb.observe({"a": (short(8), 0), "b": (CALM, 0), "c": (CALM, 0)})
    assert rb.rebalance() == []
    assert (a.capacity, b.capacity, c.capacity) == (8, 24, 8)
    assert budget.unassigned_bytes == 0
    assert all(not seen.moves for seen in rb.history.values())


def test_a_donor_whose_resizer_refuses_is_not_counted_on() -> None:
    """b reported no promised pages, but a request admitted since then may need 24: its
    resizer refuses the shrink, so b is no donor and c does not shrink for nothing."""
    budget = KvBudget(8 * 100 + 24 * 100 + 8 * 100)
    add(budget, "a", 8, segment=8)
    need = [24]
    b = add(budget, "b", 24, promised=lambda: need[0])
    c = add(budget, "c", 8, used=4)
    clock = Clock()
    rb = rebalancer(budget, clock)
    rb.observe({"a": (short(8), 0), "b": (CALM, 0), "c": (CALM, 0)})
    assert (rb.reclaimable_pages("b"), rb.is_donor("b")) == (0, False)
    assert rb.rebalance() == []
    assert (b.capacity, c.capacity) == (24, 8)
    need[0] = 0  # the request finished
    assert rb.rebalance() == [Move("a", 800, {"b": 800})]
    assert (b.capacity, c.capacity) == (16, 8)


def test_disabled_moves_nothing() -> None:
    budget = KvBudget(16 * 100 + 16 * 100 + 8 * 100)
    add(budget, "a", 16)
    add(budget, "b", 16)
    clock = Clock()
    rb = rebalancer(budget, clock, enabled=False)
    for now in (0.0, 100.0, 1000.0):
        clock.now = now
        rb.observe({"a": (short(16), 0), "b": (CALM, 0)})
        assert rb.rebalance() == []
    assert capacities(budget) == {"a": 16, "b": 16}
    assert all(not seen.moves and not seen.moved_bytes for seen in rb.history.values())


def test_counters_and_bytes_add_up() -> None:
    budget = KvBudget(8 * 1000 + 16 * 1024 + 12 * 1500 + 1000)
    add(budget, "a", 8, segment=8, page_bytes=1000)
    add(budget, "b", 16, segment=4, page_bytes=1024)
    add(budget, "c", 12, segment=3, page_bytes=1500)
    clock = Clock()
    rb = rebalancer(budget, clock, cooldown_s=2.0)
    unassigned = budget.unassigned_bytes
    moves: list[Move] = []
    pressure = {"a": short(8), "b": CALM, "c": CALM}
    for step in range(40):
        clock.now = float(step)
        if step == 10:
            pressure = {"a": CALM, "b": short(8), "c": CALM}
        if step == 20:
            pressure = {"a": CALM, "b": CALM, "c": short(6)}
        rb.observe({name: (p, 0) for name, p in pressure.items()})
        moves.extend(rb.rebalance())
    assert {move.taker for move in moves} == {"a", "b", "c"}
    assert rb.history["a"].moves["in"] and rb.history["a"].moves["out"]
    taken = sum(move.taken_bytes for move in moves)
    given = sum(sum(move.given.values()) for move in moves)
    assert given >= taken - unassigned
    assert budget.unassigned_bytes == unassigned + given - taken
    for name, seen in rb.history.items():
        assert seen.moves["in"] == sum(1 for m in moves if m.taker == name and m.taken_bytes)
        assert seen.moves["out"] == sum(1 for m in moves if name in m.given)
        assert seen.moved_bytes["in"] == sum(m.taken_bytes for m in moves if m.taker == name)
        assert seen.moved_bytes["out"] == sum(m.given.get(name, 0) for m in moves)
    assert sum(seen.moved_bytes["in"] for seen in rb.history.values()) == taken
    assert sum(seen.moved_bytes["out"] for seen in rb.history.values()) == given
    budget.check()


def test_every_resize_a_move_makes_is_told_to_its_pool_once() -> None:
    """The agent counts, logs and records the evacuation of each resize through `on_resize`:
    a donor that gives to two takers in one check is told twice, a taker once."""
    budget = KvBudget(3 * 16 * 100)  # full
    for name in ("a", "b"):
        add(budget, name, 16)
    add(budget, "c", 16)
    told: list[tuple[str, int]] = []
    for name, member in budget.pools.items():
        member.on_resize = lambda old, _evicted, name=name: told.append((name, old))
    clock = Clock()
    rb = rebalancer(budget, clock)
    rb.observe({"a": (short(4), 0), "b": (short(4), 0), "c": (CALM, 0)})
    moves = rb.rebalance()
    assert [move.given for move in moves] == [{"c": 400}, {"c": 400}]
    assert told == [("c", 16), ("a", 16), ("c", 12), ("b", 16)]
    assert capacities(budget) == {"a": 20, "b": 20, "c": 8}


# ---- taking back what was lent ------------------------------------------------------------


def test_a_pool_below_its_share_takes_it_back_from_a_busy_borrower_within_reclaim_s() -> None:
    """b lent 8 pages while calm; a then stays under pressure, so it is never a donor. b, under
    pressure and below its share, takes its pages back after `reclaim_s` despite the cooldown,
    and no more than its share."""
    budget = KvBudget(16 * 100 + 16 * 100)
    add(budget, "a", 16)
    add(budget, "b", 16)
    clock = Clock()
    rb = rebalancer(budget, clock, cooldown_s=60.0, reclaim_s=2.0)
    rb.observe({"a": (short(8), 0), "b": (CALM, 0)})
    assert rb.rebalance() == [Move("a", 800, {"b": 800})]
    assert capacities(budget) == {"a": 24, "b": 8}
    for now in (0.5, 1.0, 1.5, 2.0):  # both busy now; b waits reclaim_s
        clock.now = now
        rb.observe({"a": (short(8), 0), "b": (short(20), 0)})
        if now < 2.0:
            assert rb.rebalance() == []
    clock.now = 2.5
    rb.observe({"a": (short(8), 0), "b": (short(20), 0)})
    assert rb.rebalance() == [Move("b", 800, {"a": 800})]
    assert capacities(budget) == {"a": 16, "b": 16}  # back to the shares, not beyond
    clock.now = 5.0
    rb.observe({"a": (short(8), 0), "b": (short(20), 0)})
    assert rb.rebalance() == []  # a is at its share: nothing more is owed to b
    budget.check()


def test_taking_back_preempts_the_borrowers_youngest_requests_when_their_pages_are_in_the_way():
    """The borrower's pages in use reach above its share: its shrink can only go ahead once
    requests have let go of them (the agent preempts its youngest; here a fake frees them)."""
    budget = KvBudget(16 * 100 + 16 * 100)
    a = add(budget, "a", 16)
    add(budget, "b", 16)
    clock = Clock()
    rb = rebalancer(budget, clock, cooldown_s=60.0, reclaim_s=0.0)
    rb.observe({"a": (short(8), 0), "b": (CALM, 0)})
    rb.rebalance()
    a.allocate("busy", 22 * PAGE_SIZE)  # a uses 22 of its 24 pages
    asked: list[int] = []

    def make_room(pages: int) -> int:
        asked.append(pages)
        a.free("busy")
        return 1

    budget.pools["a"].make_room = make_room
    clock.now = 1.0
    rb.observe({"a": (short(8), 0), "b": (short(8), 0)})
    assert rb.rebalance() == [Move("b", 800, {"a": 800})]
    assert asked == [16]
    assert capacities(budget) == {"a": 16, "b": 16}


def test_taking_back_never_shrinks_a_borrower_below_what_one_request_was_promised() -> None:
    budget = KvBudget(16 * 100 + 16 * 100)
    add(budget, "a", 16, promised=lambda: 20)
    add(budget, "b", 16)
    clock = Clock()
    rb = rebalancer(budget, clock, cooldown_s=60.0, reclaim_s=0.0)
    budget.pools["b"].resizer.resize(8)
    budget.pools["a"].resizer.resize(24)
    rb.observe({"a": (short(8), 20), "b": (short(8), 0)})
    assert rb.rebalance() == [Move("b", 400, {"a": 400})]
    assert capacities(budget) == {"a": 20, "b": 12}
