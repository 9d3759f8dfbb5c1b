"""Moving memory between the pools of one budget, to the pool whose load needs it now.

At every check the agent tells the rebalancer, per pool, what pressure it is under since the
previous check (`Pressure`: pages its waiting requests need beyond what is free or evictable,
failed allocations, preemptions) and how many pages its admitted requests may still need. A pool
that has been under pressure for `pressure_s` takes memory: first budget no pool holds, then
whole segments from donors, the pools with the most reclaimable memory first. A donor has been
free of pressure for `calm_s`; it gives only pages beyond its floor, what its admitted requests
may still need, and its peak use over the last `peak_window_s` plus `headroom_ratio` of it (by
default it keeps twice what it used at its busiest in the last 20 s). So giving never touches a
live page (its shrink evacuates the tail by defragmentation first), and a donor is not squeezed
to what it happens to use at one instant: a pool sized at its current use preempts as soon as
its running requests grow, and it cannot take memory back from a taker that stays under
pressure. Cached prefix pages count as reclaimable: the shrink evicts them.

Hysteresis: pressure and calm must hold for a while, and after a move the taker may not give and
the donor may not take for `cooldown_s`, so two pools whose load alternates do not pass the same
segments back and forth. A pinned pool (sized by an operator) neither gives nor takes until it is
released, a sleeping one until it wakes (it then takes back at once what was borrowed of its
share: `make_room`). Idle pools keep their memory until someone needs it: moving costs a
defragmentation, and memory that sits in an idle pool costs nothing.

Lending is not giving away. A pool below its share (the pages it started with) that has been
under pressure for `reclaim_s` takes memory back from the pools above theirs, busy or not and
whatever their cooldown: each shrinks toward its share, evicting its cached pages and, when its
running requests hold the pages, preempting its youngest requests (they are recomputed later,
as after any preemption) until the shrink fits. It never goes below its share or what one of its
requests was promised. Without this, a pool that lent memory during a lull could wait as long
as its borrower stayed busy (a busy pool is never calm, so never a donor), with a request that
fits its own share neither served nor refused.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvctl.agent.budget.kv_budget import BudgetedPool, KvBudget
from kvctl.agent.pool import ResizeRefused
from kvctl.settings import RebalanceSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pressure:
    """A pool's signs of pressure since the previous check."""

    short_pages: int = 0
    """Pages its waiting requests need beyond what is free or evictable."""
    failures: int = 0
    """Allocations that failed."""
    preemptions: int = 0

    @property
    def any(self) -> bool:
        return self.short_pages > 0 or self.failures > 0 or self.preemptions > 0


@dataclass(frozen=True)
class Move:
    """Memory moved to one pool at one check: `taker` grew by `taken_bytes`, after each donor in
    `given` gave that many bytes (none: the budget had them unassigned)."""

    taker: str
    taken_bytes: int
    given: dict[str, int] = field(default_factory=dict)


@dataclass
class PoolHistory:
    """What the rebalancer remembers about one pool between checks."""

    pressure: Pressure = Pressure()
    promised_pages: int = 0
    pressured_since: float | None = None
    calm_since: float | None = None
    took_at: float = float("-inf")
    gave_at: float = float("-inf")
    moves: Counter[str] = field(default_factory=Counter)  # "in", "out"
    moved_bytes: Counter[str] = field(default_factory=Counter)
    used: deque[tuple[float, int]] = field(default_factory=deque)  # (time, used pages)
    reclaimable_pages: int = 0  # as at the last check or move (readings show these)
    donor: bool = False

    def peak_used(self, now: float, window: float) -> int:
        """The most pages the pool used at a check within the last `window` seconds."""
        while len(self.used) > 1 and self.used[0][0] < now - window:
            self.used.popleft()
        return max((pages for _, pages in self.used), default=0)


class Rebalancer:
    """Decides and carries out moves between the pools of `budget` (on the engine thread)."""

    def __init__(
        self, budget: KvBudget, settings: RebalanceSettings, clock: Callable[[], float]
    ) -> None:
        self.budget = budget
        self.settings = settings
        self.clock = clock
        now = clock()
        self.history = {name: PoolHistory(calm_since=now) for name in budget.pools}

    # ---- what the agent reports -------------------------------------------------------------

    def observe(self, readings: Mapping[str, tuple[Pressure, int]]) -> None:
        """Record each pool's pressure since the last check and its promised pages."""
        now = self.clock()
        for name, (pressure, promised) in readings.items():
            seen = self.history[name]
            seen.pressure, seen.promised_pages = pressure, promised
            seen.used.append((now, self.budget.pools[name].pool.used_pages))
            if pressure.any:
                seen.calm_since = None
                seen.pressured_since = now if seen.pressured_since is None else seen.pressured_since
            else:
                seen.pressured_since = None
                seen.calm_since = now if seen.calm_since is None else seen.calm_since
        self._take_stock()

    def reclaimable_pages(self, name: str) -> int:
        """Whole segments the pool could give now without touching what it must keep; none if
        its resizer would refuse that shrink, so that no donor is counted on (and shrunk) for
        a move its fellow donors cannot complete."""
        member, seen = self.budget.pools[name], self.history[name]
        pool = member.pool
        used = max(pool.used_pages, seen.peak_used(self.clock(), self.settings.peak_window_s))
        keep = max(
            member.floor_pages,
            seen.promised_pages,
            used + int(used * self.settings.headroom_ratio) + pool.reserved_pages,
            1,
        )
        if not pool.can_evict:  # nothing can evict its cached pages: a shrink must keep them
            keep = max(keep, used + pool.cached_pages)
        segment = pool.segment_pages
        keep = -(-keep // segment) * segment
        if keep >= pool.capacity:
            return 0
        try:
            member.resizer.check(keep)  # e.g. a request admitted since the last reading
        except ResizeRefused:
            return 0
        return pool.capacity - keep

    def is_donor(self, name: str) -> bool:
        """Whether the pool could give memory now."""
        member, seen = self.budget.pools[name], self.history[name]
        now = self.clock()
        return (
            member.movable
            and seen.calm_since is not None
            and now - seen.calm_since >= self.settings.calm_s
            and now - seen.took_at >= self.settings.cooldown_s
            and self.reclaimable_pages(name) > 0
        )

    def _is_taker(self, name: str) -> bool:
        member, seen = self.budget.pools[name], self.history[name]
        now = self.clock()
        return (
            member.movable
            and seen.pressured_since is not None
            and now - seen.pressured_since >= self.settings.pressure_s
            and now - seen.gave_at >= self.settings.cooldown_s
            and member.pool.capacity < member.ceiling_pages
        )

    def _reclaims(self, name: str) -> bool:
        """Whether the pool, below its share and under pressure for `reclaim_s`, may take back
        what it lent (no cooldown holds it)."""
        member, seen = self.budget.pools[name], self.history[name]
        return (
            member.movable
            and seen.pressured_since is not None
            and self.clock() - seen.pressured_since >= self.settings.reclaim_s
            and member.pool.capacity < min(member.share_pages, member.ceiling_pages)
        )

    def excess_pages(self, name: str) -> int:
        """Whole segments the pool holds beyond its share, its floor and what one of its
        requests was promised: what a lender may take back from it, busy or not."""
        member = self.budget.pools[name]
        if not member.movable:
            return 0
        pool, segment = member.pool, member.pool.segment_pages
        promised = member.resizer.promised() if member.resizer.promised is not None else 0
        keep = max(member.share_pages, member.floor_pages, promised, 1)
        keep = -(-keep // segment) * segment
        return max(0, pool.capacity - keep)

    # ---- moving -----------------------------------------------------------------------------

    def rebalance(self) -> list[Move]:
        """Give memory to every pool that has been under pressure long enough, most short of
        pages first; the moves carried out."""
        if not self.settings.enabled:
            return []
        takers = [
            name for name in self.budget.pools if self._is_taker(name) or self._reclaims(name)
        ]
        # those taking back what they lent first, then the most short of pages
        takers.sort(key=lambda n: (not self._reclaims(n), -self.history[n].pressure.short_pages))
        moves: list[Move] = []
        took: set[str] = set()  # a pool takes or gives at one check, never both
        gave: set[str] = set()
        for name in takers:
            if name not in gave and (move := self._feed(self.budget.pools[name], took)):
                moves.append(move)
                took.add(name)
                gave.update(move.given)
        if moves:
            self._take_stock()
        return moves

    def _take_stock(self) -> None:
        """Note each pool's reclaimable pages and whether it could give, for the readings the
        agent publishes every 100 ms: computed per check and per move, not per reading (each
        asks the pool's resizer, which walks its requests)."""
        for name, seen in self.history.items():
            seen.reclaimable_pages = self.reclaimable_pages(name)
            seen.donor = self.is_donor(name)

    def _wanted_pages(self, taker: BudgetedPool) -> int:
        """Pages the taker should grow by: what its queue is short of, at least one segment,
        whole segments, up to its ceiling."""
        pool = taker.pool
        segment = pool.segment_pages
        seen = self.history[taker.name]
        short = max(seen.pressure.short_pages, seen.promised_pages - pool.capacity, segment)
        wanted = -(-short // segment) * segment
        return min(wanted, taker.ceiling_pages - pool.capacity)

    def _feed(self, taker: BudgetedPool, took: set[str]) -> Move | None:
        """Grow `taker` from the unassigned budget, calm donors and (below its share) the pools
        holding more than theirs; none of `took`, which took memory at this check."""
        budget = self.budget
        segment_bytes = taker.segment_bytes
        wanted_bytes = self._wanted_pages(taker) * taker.pool.bytes_per_page
        others = [name for name in budget.pools if name != taker.name and name not in took]
        donors = [name for name in others if self.is_donor(name)]
        donors.sort(key=self._reclaimable_bytes, reverse=True)
        borrowers, owed = self._borrowers(taker, [n for n in others if n not in donors])
        reachable = budget.unassigned_bytes + sum(map(self._reclaimable_bytes, donors)) + owed
        wanted_bytes = min(wanted_bytes, reachable // segment_bytes * segment_bytes)
        if wanted_bytes < segment_bytes:
            return None  # not even one of the taker's segments can be had: move nothing
        given: dict[str, int] = {}
        for name in donors:
            missing = wanted_bytes - budget.unassigned_bytes
            if missing <= 0:
                break
            gave, _ = self._shrink(budget.pools[name], missing, self.reclaimable_pages(name))
            if gave:
                given[name] = gave
        for name in borrowers:
            missing = min(wanted_bytes - budget.unassigned_bytes, owed)
            if missing <= 0:
                break
            if gave := self._take_back(budget.pools[name], missing, taker.name):
                given[name] = given.get(name, 0) + gave
                owed -= gave
        taken = self._grow(taker, wanted_bytes)
        return Move(taker.name, taken, given) if taken or given else None

    def make_room(self, taker: str, wanted_bytes: int) -> int:
        """For a model waking up: shrink the pools above their share (most excess first, as a
        lender takes back what it lent) until the budget has `wanted_bytes` unassigned or none
        is above its share; the bytes unassigned then."""
        budget = self.budget
        others = [name for name in budget.pools if name != taker and self.excess_pages(name)]
        others.sort(key=self._excess_bytes, reverse=True)
        for name in others:
            missing = wanted_bytes - budget.unassigned_bytes
            if missing <= 0:
                break
            self._take_back(budget.pools[name], missing, taker)
        return budget.unassigned_bytes

    def _borrowers(self, taker: BudgetedPool, others: list[str]) -> tuple[list[str], int]:
        """Those of `others` above their share that the taker may take memory back from (most
        excess first), and how many bytes it may take back: up to its share."""
        if not self._reclaims(taker.name):
            return [], 0
        borrowers = [name for name in others if self.excess_pages(name) > 0]
        borrowers.sort(key=self._excess_bytes, reverse=True)
        pool = taker.pool
        owed = (taker.share_pages - pool.capacity) * pool.bytes_per_page
        return borrowers, min(owed, sum(map(self._excess_bytes, borrowers)))

    def _excess_bytes(self, name: str) -> int:
        return self.excess_pages(name) * self.budget.pools[name].pool.bytes_per_page

    def _take_back(self, borrower: BudgetedPool, missing_bytes: int, taker: str) -> int:
        """Shrink a pool above its share by whole segments covering `missing_bytes` (not below
        its share), preempting its youngest requests first if their pages are in the way; the
        bytes given."""
        excess = self.excess_pages(borrower.name)
        given, preempted = self._shrink(borrower, missing_bytes, excess, preempt=True)
        if given:
            log.info(
                "rebalance: pool %s gave %s bytes back to %s, below its share (%d requests "
                "preempted)",
                borrower.name,
                f"{given:,}",
                taker,
                preempted,
            )
        return given

    def _reclaimable_bytes(self, name: str) -> int:
        return self.reclaimable_pages(name) * self.budget.pools[name].pool.bytes_per_page

    def _shrink(
        self, donor: BudgetedPool, missing_bytes: int, givable_pages: int, preempt: bool = False
    ) -> tuple[int, int]:
        """Shrink `donor` by whole segments covering `missing_bytes`, at most `givable_pages`;
        with `preempt`, its youngest requests are preempted first when their pages are in the
        way. The bytes given (0 when the shrink was refused) and the requests preempted."""
        pool = donor.pool
        wanted = -(-missing_bytes // donor.segment_bytes)
        segments = min(wanted, givable_pages // pool.segment_pages)
        if segments < 1:
            return 0, 0
        before = pool.capacity
        target = before - segments * pool.segment_pages
        preempted = 0
        if preempt and donor.make_room is not None:
            try:
                donor.resizer.check(target)
            except ResizeRefused:
                preempted = donor.make_room(target)
        try:
            donor.resize(target)
        except ResizeRefused as refused:
            log.info("rebalance: pool %s could not give memory: %s", donor.name, refused)
            return 0, preempted
        given = (before - pool.capacity) * pool.bytes_per_page
        seen = self.history[donor.name]
        seen.gave_at = self.clock()
        seen.moves["out"] += 1
        seen.moved_bytes["out"] += given
        return given, preempted

    def _grow(self, taker: BudgetedPool, wanted_bytes: int) -> int:
        """Grow the taker by the whole segments of `wanted_bytes` the budget has room for."""
        pool = taker.pool
        segments = min(wanted_bytes, self.budget.unassigned_bytes) // taker.segment_bytes
        if segments < 1:
            return 0
        before = pool.capacity
        try:
            taker.resize(before + segments * pool.segment_pages)
        except ResizeRefused as refused:  # e.g. the device has no memory for the segments
            log.warning("rebalance: pool %s could not grow: %s", taker.name, refused)
            return 0
        grown = (pool.capacity - before) * pool.bytes_per_page
        seen = self.history[taker.name]
        seen.took_at = self.clock()
        seen.moves["in"] += 1
        seen.moved_bytes["in"] += grown
        return grown
