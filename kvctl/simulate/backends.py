"""The two allocators as the simulated scheduler sees them: same questions, different memory.

The scheduler asks each side the same things: does memory look free for this request
(`looks_free`), start it (`start`), make room for more tokens (`extend`), drop it (`release`),
do per-step housekeeping, and give one sample of its memory. How each side answers is the
difference being measured:

- `ContiguousSide` reserves prompt + maximum output as one range of one first-fit arena shared by
  every model (ranges sized by each model's bytes per token). Starting a request either gets its
  range or raises `OutOfMemory`; decoding never needs more memory.
- `PagedSide` keeps one `PagePool` per model (a page holds `page_size` tokens of that model's KV),
  allocates the prompt at start and pages as tokens are generated, and runs `AutoDefrag` every
  step. With several models the pools are carved from the shared budget in equal-byte *segments*:
  a pool that runs short grows by whole segments (`PoolResizer.resize`) from the unassigned budget,
  or reclaims whole free segments from the other pools (a shrink evacuates their tails first); a
  pool whose utilisation stays below half for 16 steps shrinks back to 75 % utilisation, returning
  segments to the budget. When no room can be made, `extend` says so and the scheduler preempts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvctl.agent.pool import (
    AutoDefrag,
    Defragmenter,
    PagePool,
    PoolResizer,
    ResizeRefused,
)
from kvctl.occupancy import fragmentation_of
from kvctl.settings import DefragSettings
from kvctl.simulate.contiguous import ContiguousAllocator
from kvctl.simulate.workloads import Model, Request, Workload

MIN_SEGMENT_BYTES = 64 * 2**20
"""Segments are the smallest multiple of every pool's page bytes at or above this size."""
LOW_UTILIZATION = 0.5
"""A pool whose used ÷ capacity stays below this for `SHRINK_AFTER_STEPS` steps shrinks."""
SHRINK_AFTER_STEPS = 16
SHRINK_TO_UTILIZATION = 0.75
"""A shrinking pool keeps enough whole segments to sit at about this utilisation."""


@dataclass
class RequestState:
    """One request's progress on one side: tokens generated so far and how it ended."""

    request: Request
    kv_bytes_per_token: int
    generated: int = 0
    admitted_at: int = -1
    preemptions: int = 0
    failed: bool = False

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def stored_tokens(self) -> int:
        """Tokens whose KV is held while running: prompt + generated (recomputed if preempted)."""
        return self.request.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        return self.request.output_tokens - self.generated


@dataclass(frozen=True)
class MemorySample:
    """One step's reading of a side's memory, in bytes."""

    reserved_bytes: int  # held by requests (ranges or pages), whether or not filled
    fragmentation: float  # 1 − largest free run ÷ free, as the pool defines it
    free_extents: int


class Side(Protocol):
    """What the scheduler needs from an allocator."""

    name: str

    def looks_free(self, state: RequestState) -> bool: ...

    def start(self, state: RequestState) -> bool: ...

    def extend(self, state: RequestState, tokens: int) -> bool: ...

    def release(self, state: RequestState) -> None: ...

    def housekeeping(self) -> None: ...

    def sample(self) -> MemorySample: ...

    def counters(self) -> dict[str, int]: ...


class ContiguousSide:
    """Prompt + maximum output reserved as one first-fit range of a shared byte arena."""

    name = "contiguous"

    def __init__(self, budget_bytes: int) -> None:
        self.arena = ContiguousAllocator(budget_bytes)

    def looks_free(self, state: RequestState) -> bool:
        return self.arena.free_bytes >= state.stored_tokens * state.kv_bytes_per_token

    def start(self, state: RequestState) -> bool:
        """Reserve the whole range; raises `OutOfMemory` when no single free range holds it."""
        per_token = state.kv_bytes_per_token
        self.arena.allocate(state.id, state.request.reserved_tokens * per_token)
        self.arena.set_used(state.id, state.stored_tokens * per_token)
        return True

    def extend(self, state: RequestState, tokens: int) -> bool:
        used = (state.stored_tokens + tokens) * state.kv_bytes_per_token
        self.arena.set_used(state.id, used)
        return True

    def release(self, state: RequestState) -> None:
        self.arena.free(state.id)

    def housekeeping(self) -> None:
        """A contiguous arena cannot move live ranges, so there is nothing to do."""

    def sample(self) -> MemorySample:
        stats = self.arena.stats()
        return MemorySample(stats.reserved, stats.fragmentation_ratio, stats.free_extents)

    def counters(self) -> dict[str, int]:
        return {
            "alloc_attempts": self.arena.alloc_attempts,
            "alloc_failures": self.arena.alloc_failures,
            "defrag_runs": 0,
            "defrag_pages_moved": 0,
            "pool_grows": 0,
            "pool_shrinks": 0,
        }


@dataclass
class ManagedPool:
    """One model's pool with its defragmenter, resizer and low-utilisation streak: what a paged
    side keeps per model (`PagedSide.pools`), and what the budget scenario builds its own from."""

    pool: PagePool
    auto: AutoDefrag
    resizer: PoolResizer
    page_bytes: int
    low_steps: int = 0


def segment_bytes(models: tuple[Model, ...], page_size: int) -> int:
    """The smallest common multiple of every model's page bytes at or above `MIN_SEGMENT_BYTES`."""
    unit = math.lcm(*(m.kv_bytes_per_token * page_size for m in models))
    return unit * max(1, -(-MIN_SEGMENT_BYTES // unit))


def usable_budget(workload: Workload, page_size: int) -> int:
    """The budget rounded down to whole pages (one model) or whole segments (several)."""
    models = workload.models
    if len(models) == 1:
        unit = models[0].kv_bytes_per_token * page_size
    else:
        unit = segment_bytes(models, page_size)
    return workload.budget_bytes // unit * unit


class PagedSide:
    """One `PagePool` per model, pages on demand, auto-defrag, segment-wise resizing."""

    name = "paged"

    def __init__(
        self,
        workload: Workload,
        budget_bytes: int,
        page_size: int,
        policy: DefragSettings,
        clock: Callable[[], float],
    ) -> None:
        self.elastic = len(workload.models) > 1
        self.segment_bytes = segment_bytes(workload.models, page_size) if self.elastic else 0
        if budget_bytes < max(len(workload.models) * self.segment_bytes, 1):
            raise ValueError(
                f"a budget of {budget_bytes} bytes cannot give each of {len(workload.models)} "
                f"pools one segment of {self.segment_bytes} bytes; raise the budget"
            )
        self.unassigned_bytes = budget_bytes
        self.pools: dict[str, ManagedPool] = {}
        for model in workload.models:
            page_bytes = model.kv_bytes_per_token * page_size
            share = self.segment_bytes if self.elastic else budget_bytes
            pages = share // page_bytes
            pool = PagePool(pages, page_size, pages, page_bytes)
            defrag = Defragmenter(pool, batch_pages=policy.step_max_pages, clock=clock)
            auto = AutoDefrag(defrag, policy, clock=clock)
            self.pools[model.name] = ManagedPool(pool, auto, PoolResizer(pool, defrag), page_bytes)
            self.unassigned_bytes -= pages * page_bytes
        self.grows = 0
        self.shrinks = 0
        self.evacuated_pages = 0

    # ---- the scheduler's questions ------------------------------------------------------

    def looks_free(self, state: RequestState) -> bool:
        mp = self.pools[state.request.model]
        need = mp.pool.pages_for(state.stored_tokens) * mp.page_bytes
        free = self.unassigned_bytes + sum(
            p.pool.free_pages * p.page_bytes for p in self.pools.values()
        )
        return free >= need

    def start(self, state: RequestState) -> bool:
        """Allocate the prompt (and any recomputed output); False when no room can be made."""
        mp = self.pools[state.request.model]
        if not self._make_room(mp, mp.pool.pages_for(state.stored_tokens)):
            return False
        mp.pool.allocate(state.id, state.stored_tokens)
        return True

    def extend(self, state: RequestState, tokens: int) -> bool:
        mp = self.pools[state.request.model]
        table = mp.pool.table(state.id)
        need = mp.pool.pages_for(table.num_tokens + tokens) - len(table.pages)
        if need > 0 and not self._make_room(mp, need):
            return False
        mp.pool.append(state.id, tokens)
        return True

    def release(self, state: RequestState) -> None:
        self.pools[state.request.model].pool.free(state.id)

    def housekeeping(self) -> None:
        """One auto-defrag tick per pool, then give back segments of pools that stay underused."""
        for mp in self.pools.values():
            mp.auto.tick()
            if self.elastic:
                self._maybe_shrink(mp)

    def sample(self) -> MemorySample:
        free = largest = extents = reserved = 0
        for mp in self.pools.values():
            stats = mp.pool.stats()
            free += stats.free_run_pages * mp.page_bytes  # as PoolOccupancy.fragmentation_ratio
            largest += stats.largest_free_run * mp.page_bytes
            extents += stats.free_extents
            reserved += stats.used_pages * mp.page_bytes
        return MemorySample(reserved, fragmentation_of(largest, free), extents)

    def counters(self) -> dict[str, int]:
        pools = [mp.pool for mp in self.pools.values()]
        autos = [mp.auto for mp in self.pools.values()]
        return {
            "alloc_attempts": sum(p.alloc_attempts for p in pools),
            "alloc_failures": sum(p.alloc_failures for p in pools),
            "defrag_runs": sum(sum(a.runs_total.values()) for a in autos),
            "defrag_pages_moved": sum(a.pages_moved_total for a in autos) + self.evacuated_pages,
            "pool_grows": self.grows,
            "pool_shrinks": self.shrinks,
        }

    # ---- segments -----------------------------------------------------------------------

    def _make_room(self, mp: ManagedPool, pages: int) -> bool:
        """Ensure `pages` free pages in `mp`, growing it by whole segments if the budget allows."""
        short = pages - mp.pool.free_pages
        if short <= 0:
            return True
        if not self.elastic:
            return False
        segments = -(-short // mp.pool.segment_pages)
        missing = segments - self.unassigned_bytes // self.segment_bytes
        if missing > 0:
            self._reclaim(missing, exclude=mp)
        if self.unassigned_bytes // self.segment_bytes < segments:
            return False
        return self._resize(mp, mp.pool.capacity + segments * mp.pool.segment_pages)

    def _reclaim(self, segments: int, exclude: ManagedPool) -> None:
        """Shrink other pools by whole free segments, the emptiest first, until enough are back."""
        others = sorted(
            (mp for mp in self.pools.values() if mp is not exclude),
            key=lambda mp: mp.pool.free_pages * mp.page_bytes,
            reverse=True,
        )
        for mp in others:
            seg = mp.pool.segment_pages
            spare = min(mp.pool.free_pages // seg, mp.pool.capacity // seg - 1)
            take = min(spare, segments)
            if take and self._resize(mp, mp.pool.capacity - take * seg):
                segments -= take
            if segments <= 0:
                return

    def _maybe_shrink(self, mp: ManagedPool) -> None:
        pool = mp.pool
        seg = pool.segment_pages
        if pool.capacity > seg and pool.used_pages < LOW_UTILIZATION * pool.capacity:
            mp.low_steps += 1
        else:
            mp.low_steps = 0
        if mp.low_steps < SHRINK_AFTER_STEPS:
            return
        mp.low_steps = 0
        keep = math.ceil(pool.used_pages / SHRINK_TO_UTILIZATION)
        target = max(seg, -(-keep // seg) * seg)
        if target < pool.capacity:
            self._resize(mp, target)

    def _resize(self, mp: ManagedPool, pages: int) -> bool:
        """Resize `mp` and move the difference between it and the unassigned budget."""
        old = mp.pool.capacity
        try:
            result = mp.resizer.resize(pages)
        except ResizeRefused:
            return False
        delta_segments = (result.new_pages - old) // mp.pool.segment_pages
        self.unassigned_bytes -= delta_segments * self.segment_bytes
        self.evacuated_pages += result.pages_moved
        if result.direction == "grow":
            self.grows += 1
        elif result.direction == "shrink":
            self.shrinks += 1
        return True
