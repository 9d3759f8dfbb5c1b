"""One memory budget for the KV pools of several models on one agent.

Every byte a pool holds counts against the budget (`--kv-budget`). A pool grows only into bytes
no pool holds: each pool's resizer asks the budget for room before it adds a segment, so the sum
of the pools never exceeds the budget at any step, whoever resizes (an operator, automatic
resize, the rebalancer). A shrink gives its bytes back. Each pool has a floor and a ceiling,
which are its resizer's `min_pages` and `max_pages`.

Pools of different models have pages of different sizes, so the budget counts bytes, and every
pool moves in whole segments of its own.

Each pool also has a share: the pages it started with (or an operator gave it), the shares
together never more than the budget. Memory a pool lends beyond its share stays its own: the
rebalancer gives it back when the lender needs it, however busy the borrower is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvctl.agent.pool import InvariantViolated, PagePool, PoolResizer
from kvctl.units import format_bytes


class BudgetError(ValueError):
    """Pools that cannot share the budget as configured (their sizes exceed it)."""


class BudgetCorrupted(InvariantViolated):
    """The pools under a budget hold more than it, or a pool is outside its floor or ceiling
    (`KvBudget.check`): a bug, never a user error."""


@dataclass
class BudgetedPool:
    """One pool under the budget: its resizer (and through it the pool), and whether an
    operator pinned its size."""

    name: str
    resizer: PoolResizer
    pinned: bool = False
    asleep: bool = False
    """The model sleeps: its pool holds no memory (its storage is parked), it has no floor, and
    it neither gives nor takes until it wakes; its share stays its own, lent meanwhile."""
    share_pages: int = 0
    """The pages this pool may always take back: what it started with, or was sized to by an
    operator (within what the other pools' shares leave)."""
    on_resize: Callable[[int, int], object] | None = None
    """Told (old pages, pages evicted) after each resize the rebalancer makes, so the agent
    counts, logs and accounts for it like any other."""
    make_room: Callable[[int], int] | None = None
    """Preempts the pool's youngest requests until at most the given pages are in use, so a
    shrink back to a lender's share can go ahead; returns how many it preempted."""

    def resize(self, pages: int) -> None:
        """Resize through the pool's resizer (`ResizeRefused` changes nothing)."""
        old = self.pool.capacity
        result = self.resizer.resize(pages)
        if self.on_resize is not None:
            self.on_resize(old, result.pages_evicted)

    @property
    def pool(self) -> PagePool:
        return self.resizer.pool

    @property
    def movable(self) -> bool:
        """Whether the rebalancer may resize it: not pinned by an operator, not asleep."""
        return not self.pinned and not self.asleep

    @property
    def bytes(self) -> int:
        if self.asleep:
            return 0
        return self.pool.capacity * self.pool.bytes_per_page

    @property
    def segment_bytes(self) -> int:
        return self.pool.segment_pages * self.pool.bytes_per_page

    @property
    def floor_pages(self) -> int:
        return 0 if self.asleep else self.resizer.min_pages

    @property
    def ceiling_pages(self) -> int:
        return self.resizer.max_pages or self.pool.capacity


class KvBudget:
    """The budget shared by the pools added to it; `unassigned_bytes` is what a pool may grow
    by."""

    def __init__(self, total_bytes: int) -> None:
        if total_bytes < 1:
            raise BudgetError(f"the KV budget must be more than 0 bytes, got {total_bytes}")
        self.total_bytes = total_bytes
        self.pools: dict[str, BudgetedPool] = {}

    def add(self, name: str, resizer: PoolResizer) -> BudgetedPool:
        """Put a pool under the budget; BudgetError if the budget cannot hold it as it is."""
        if name in self.pools:
            raise BudgetError(f"two pools are named {name!r}")
        member = BudgetedPool(name, resizer, share_pages=resizer.pool.capacity)
        if self.assigned_bytes + member.bytes > self.total_bytes:
            raise BudgetError(
                f"pool {name!r} of {format_bytes(member.bytes)} does not fit the KV budget of "
                f"{format_bytes(self.total_bytes)} next to the other pools "
                f"({format_bytes(self.assigned_bytes)}); give smaller pools or a larger budget"
            )
        self.pools[name] = member
        resizer.room = lambda: self.unassigned_bytes
        return member

    def set_share(self, name: str, pages: int) -> None:
        """Make `pages` pool `name`'s share (an operator sized it), as far as the other pools'
        shares leave room: the shares never promise more than the budget holds."""
        member = self.pools[name]
        others = sum(
            other.share_pages * other.pool.bytes_per_page
            for other_name, other in self.pools.items()
            if other_name != name
        )
        room = (self.total_bytes - others) // member.pool.bytes_per_page
        member.share_pages = max(0, min(pages, room))

    @property
    def assigned_bytes(self) -> int:
        """Bytes the pools hold now."""
        return sum(member.bytes for member in self.pools.values())

    @property
    def unassigned_bytes(self) -> int:
        return self.total_bytes - self.assigned_bytes

    def reachable_pages(self, name: str) -> int:
        """The most pages pool `name` could hold if every other pool gave it all but its floor
        (its ceiling at most; its capacity while pinned): what admission may count on."""
        member = self.pools[name]
        pool = member.pool
        if member.pinned:
            return pool.capacity
        kept = sum(
            other.floor_pages * other.pool.bytes_per_page
            for other_name, other in self.pools.items()
            if other_name != name
        )
        pages = (self.total_bytes - kept) // pool.bytes_per_page
        whole = pages // pool.segment_pages * pool.segment_pages
        return max(pool.capacity, min(member.ceiling_pages, whole))

    def check(self) -> None:
        """Raise `BudgetCorrupted`, naming every `problems()`, unless every pool is within its
        bounds and all fit the budget."""
        problems = self.problems()
        if problems:
            raise BudgetCorrupted("; ".join(problems))

    def problems(self) -> list[str]:
        """Every way the pools break the budget or their bounds, described (empty when none)."""
        problems: list[str] = []
        if self.assigned_bytes > self.total_bytes:
            problems.append(
                f"pools hold {self.assigned_bytes} bytes, over the budget of {self.total_bytes}"
            )
        shares = sum(m.share_pages * m.pool.bytes_per_page for m in self.pools.values())
        if shares > self.total_bytes:
            problems.append(
                f"pool shares add up to {shares} bytes, over the budget of {self.total_bytes}"
            )
        for member in self.pools.values():
            if member.asleep:
                continue
            capacity = member.pool.capacity
            if capacity < member.floor_pages:
                problems.append(f"{member.name}: {capacity} below its floor")
            if capacity > member.ceiling_pages:
                problems.append(f"{member.name}: {capacity} over its ceiling")
        return problems
