"""One served model on the agent: its engine (pool, scheduler, prefix cache, tiers), the names
clients reach it by, and every action and reading of its pool.

An agent serves one model or several; each has one of these, named by the model (the `pool`
label of its metrics). The rule that divides the work with `AgentService`: what concerns one
model's pool is written here, once (defrag, resize, tier resize, release, the page map, the
snapshot, and in `ModelSleep` the model's sleeping and waking); what weighs one model against the
others or needs the whole agent (finding a pool by name, the engine thread, admission, the shared
budget and its rebalancing, the last awake model, room for a wake) is the service's. A route
finds the pool and runs its action on the engine thread through `AgentService.call`: the action
has one owner, so there is one place to change it and one check of its caller.

Everything here runs on the agent's one engine thread, except reading `snapshot`, which is
replaced whole; the commands a route runs are `engine_only` and refuse any other caller while
the engine thread runs.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvctl.agent.api_views import (
    defrag_view,
    occupancy_fields,
    residency_view,
    resize_direction,
    resize_view,
    tier_view,
)
from kvctl.agent.autoresize import AutoResize
from kvctl.agent.budget import BudgetedPool, KvBudget, Pressure
from kvctl.agent.model_sleep import ModelSleep, Reload
from kvctl.agent.observe.metrics import Histograms
from kvctl.agent.observe.tally import Tally
from kvctl.agent.observe.window import CounterRatioWindow
from kvctl.agent.pool import DefragReport, DefragTrigger, PoolError, ResizeRefused
from kvctl.agent.pool.stats import PageStates
from kvctl.agent.runtime import Engine
from kvctl.agent.runtime.thread_owner import ThreadOwner, engine_only
from kvctl.agent.served import ServedModel
from kvctl.api import (
    DefragResult,
    GpuMemory,
    PoolShare,
    PoolSnapshot,
    ResizeResult,
    RuntimeSettings,
)
from kvctl.settings import StartupLimits

log = logging.getLogger(__name__)

ResizeRefusal = PoolError
"""What `ModelPool.resize` raises when it changes nothing: the pool's own refusals."""

# What a sleeping pool reads as 0: its storage is parked, whatever its bookkeeping keeps
_HELD_BY_AWAKE_POOLS = (
    "segments",
    "capacity_pages",
    "free_pages",
    "free_extents",
    "largest_free_run",
    "reserved_pages",
)


@dataclass(frozen=True)
class AgentReadings:
    """What every pool's snapshot carries about the agent as a whole."""

    alert_notifications_dropped_total: int
    admin_actions_total: dict[str, int]
    gpus: list[GpuMemory]
    share: PoolShare | None = None


def _alone() -> AgentReadings:
    """What a pool no service serves yet knows of an agent: nothing."""
    return AgentReadings(alert_notifications_dropped_total=0, admin_actions_total={}, gpus=[])


class ModelPool:
    """One model's engine and what the agent keeps about its pool."""

    def __init__(
        self,
        engine: Engine,
        name: str,
        limits: StartupLimits,
        served: ServedModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        window: float = 300.0,
        max_waiting: int = 256,
        reload: Reload | None = None,
    ) -> None:
        self.engine = engine
        self.name = name
        self.limits = limits
        self.served = served or ServedModel((name,), None, engine.model_config.max_context_len)
        self.clock = clock
        self.wall_clock = wall_clock
        self.window = window
        self.max_waiting = max_waiting
        self.budget: KvBudget | None = None  # set when the pool shares one
        self.agent_readings: Callable[[], AgentReadings] = _alone  # set by the service
        cache = engine.prefix_cache
        self.histograms = Histograms() if cache is None else Histograms(residency=cache.residency)
        self.sleep = ModelSleep(engine, name, self.histograms.wake, reload, clock)
        self.rejected = Tally()
        self.resizes_total: Counter[str] = Counter({"grow": 0, "shrink": 0})
        self.auto_resize = AutoResize(RuntimeSettings().resize, self.clock)
        self._alloc_window = CounterRatioWindow(window, self.clock)
        self._prefix_window = CounterRatioWindow(window, self.clock)
        self._last_defrag: DefragResult | None = None  # as the snapshot shows it
        self._last_defrag_at: float | None = None
        self._seen_failures = engine.pool.alloc_failures
        self._seen_preemptions = engine.scheduler.preemptions
        engine.auto_defrag.add_listener(self._note_defrag)
        self.snapshot: PoolSnapshot | None = None

    @property
    def owner(self) -> ThreadOwner:
        """The owner of the engine's thread, which the commands check."""
        return self.engine.owner

    @property
    def member(self) -> BudgetedPool | None:
        """The pool's place in the shared budget; None when it has the agent to itself."""
        return None if self.budget is None else self.budget.pools[self.name]

    # ---- settings -----------------------------------------------------------------------

    def apply_settings(self, settings: RuntimeSettings) -> None:
        """The runtime settings in force, applied to this pool (engine thread). A pool sharing
        a budget keeps its own floor and ceiling; `resize.min_pages`/`max_pages` bound a pool
        that has the agent to itself."""
        engine = self.engine
        engine.auto_defrag.policy = settings.defrag
        self.auto_resize.update_settings(settings.resize)
        resizer = engine.resizer
        if self.member is None:
            resizer.max_pages = settings.resize.max_pages or self.limits.max_pool_pages
            resizer.min_pages = settings.resize.min_pages or self.limits.segment_pages
        if engine.config.prefix_cache:
            engine.set_eviction_policy(settings.prefix_cache.eviction_policy)
        if engine.prefix_ops is not None:
            engine.prefix_ops.max_pinned_share = settings.prefix_cache.max_pinned_share
        engine.scheduler.tier_min_load_tokens = settings.prefix_cache.tier_min_load_tokens
        tiers = engine.tiers
        if tiers is not None:
            for tier in tiers.tiers:
                tiers.set_policy(
                    tier.name, getattr(settings.prefix_cache, f"{tier.name}_tier_policy")
                )

    # ---- commands (engine thread) -------------------------------------------------------

    @engine_only
    def page_states_and_snapshot(self) -> tuple[PageStates, PoolSnapshot]:
        """Every page's state and a fresh snapshot of the same moment; no page while the model
        sleeps (its storage holds none)."""
        engine = self.engine
        if self.sleep.holds_no_pages:
            states = PageStates(0, engine.pool.segment_pages, [], b"")
        else:
            states = engine.page_states()
        return states, self.publish()

    @engine_only
    def defrag_now(self, max_pages: int | None) -> DefragResult:
        """A manual defragmentation, to completion or `max_pages`."""
        return defrag_view(self.engine.auto_defrag.run_now(DefragTrigger.MANUAL, max_pages))

    @engine_only
    def resize(self, pages: int) -> ResizeResult:
        """An operator's resize to `pages`; `ResizeRefused` changes nothing (and so does a
        sleeping pool). A pool sharing a budget is pinned at its new size, its share from then
        on, until `release`d: the operator's size holds against the rebalancer."""
        result = self._resize(pages)
        member, budget = self.member, self.budget
        if member is None or budget is None:
            return result
        member.pinned = True
        budget.set_share(self.name, self.engine.pool.capacity)
        return result.model_copy(update={"pinned": True})

    @engine_only
    def release(self) -> bool:
        """Hand a pinned pool back to the rebalancer; whether it was pinned. ValueError when the
        pool shares no budget."""
        member = self.member
        if member is None:
            raise ValueError(
                "this pool shares no budget (start the agent with several models or "
                "--kv-budget): nothing pins it"
            )
        pinned, member.pinned = member.pinned, False
        return pinned

    def _resize(self, pages: int) -> ResizeResult:
        """Resize to `pages` (an operator's or automatic resize); nothing while asleep."""
        if not self.sleep.awake:
            raise ResizeRefused(
                f"model {self.name!r} sleeps and its pool holds no memory; wake it first "
                f"(kvctl wake --model {self.name})"
            )
        old = self.engine.pool.capacity
        result = self.engine.resizer.resize(pages)
        return self.record_resize(old, result.pages_evicted)

    def record_resize(self, old_pages: int, evicted: int = 0) -> ResizeResult:
        """Count, log and account for a resize from `old_pages` to the pool's size now (also
        one the rebalancer carried out)."""
        engine = self.engine
        new_pages = engine.pool.capacity
        direction = resize_direction(old_pages, new_pages)
        moved = 0
        if direction != "none":
            self.resizes_total[direction] += 1
            log.info(
                "pool %s resized %s: %d -> %d pages", self.name, direction, old_pages, new_pages
            )
        evacuation = engine.resizer.last_evacuation
        if direction == "shrink" and evacuation is not None:
            moved = evacuation.pages_moved
            if moved:
                engine.auto_defrag.record(evacuation)
            engine.resizer.last_evacuation = None
        return resize_view(
            old_pages,
            new_pages,
            engine.pool.bytes_per_page,
            pages_moved=moved,
            pages_evicted=evicted,
            pool=self.name,
        )

    @engine_only
    def resize_tier(self, tier: str, pages: int) -> ResizeResult:
        """Give a host or disk tier room for `pages` pages (0 turns it off); pages evicted to
        fit go down a tier. ValueError when there is no such tier."""
        tiers = self.engine.tiers
        if tiers is None:
            raise ValueError(
                "this agent has no tiers below the device pool (start it with "
                "--host-tier-memory or --disk-tier-path)"
            )
        held = tiers.tier(tier)
        page_bytes = held.page_bytes
        old_pages, before = held.index.capacity, held.counters.evicted_pages
        tiers.resize(tier, pages * page_bytes)
        new_pages = held.index.capacity
        direction = resize_direction(old_pages, new_pages)
        if direction != "none":
            log.info("%s tier resized %s: %d -> %d pages", tier, direction, old_pages, new_pages)
        return resize_view(
            old_pages,
            new_pages,
            page_bytes,
            pages_evicted=held.counters.evicted_pages - before,
            tier=tier,
            pool=self.name,
        )

    def maybe_auto_resize(self, spare_bytes: int | None) -> None:
        """Grow or shrink on utilisation when `resize.enabled` (within the budget, if any)."""
        if (self.member is not None and self.member.pinned) or not self.sleep.awake:
            return
        engine = self.engine
        stats = engine.pool.stats()
        target = self.auto_resize.decide(stats, spare_bytes, engine.pages_promised())
        if target is None or target == stats.capacity_pages:
            return
        try:
            self._resize(target)
        except ResizeRefused as refused:  # logged, never fatal (a full budget says so each time)
            level = logging.DEBUG if self.member is not None else logging.WARNING
            log.log(
                level, "automatic resize of %s to %d pages refused: %s", self.name, target, refused
            )

    def pressure(self) -> Pressure:
        """The pool's pressure since the previous call: pages its waiting requests are short of
        beyond free and evictable pages, failed allocations and preemptions."""
        engine = self.engine
        pool = engine.pool
        failures, preemptions = pool.alloc_failures, engine.scheduler.preemptions
        pressure = Pressure(
            short_pages=self.short_pages(),
            failures=failures - self._seen_failures,
            preemptions=preemptions - self._seen_preemptions,
        )
        self._seen_failures, self._seen_preemptions = failures, preemptions
        return pressure

    def short_pages(self) -> int:
        """Pages the requests that could be admitted next need beyond free and evictable ones
        (0 when the queue waits for something else, such as a full batch)."""
        scheduler = self.engine.scheduler
        room = scheduler.max_batch_seqs - len(scheduler.running)
        if not scheduler.waiting or room <= 0:
            return 0
        pool = self.engine.pool
        need = 0
        for request, _ in zip(scheduler.waiting, range(room), strict=False):
            need += scheduler.pages.pages_for(request.num_tokens + 1)
        return max(0, need - pool.free_pages - pool.cached_pages)

    def _note_defrag(self, report: DefragReport) -> None:
        self.histograms.defrag.observe(report.seconds)
        self._last_defrag, self._last_defrag_at = defrag_view(report), self.clock()

    # ---- the snapshot -------------------------------------------------------------------

    def publish(self) -> PoolSnapshot:
        """Build the snapshot now (it replaces the published one) with what the agent tells
        every pool's (`agent_readings`), and return it."""
        return self.build_snapshot(self.agent_readings())

    def build_snapshot(self, agent: AgentReadings) -> PoolSnapshot:
        """A fresh reading of the pool, the queue and the counters (engine thread)."""
        engine = self.engine
        stats = engine.stats
        pool = engine.pool.stats()
        self._alloc_window.record(
            pool.alloc_attempts_total - pool.alloc_failures_total, pool.alloc_attempts_total
        )
        successes, attempts = self._alloc_window.increases()
        now = self.clock()
        oldest = stats.oldest_queued_at
        waited = 0.0 if oldest is None else max(0.0, now - oldest)
        stalled = 0.0 if oldest is None else max(0.0, now - max(oldest, stats.last_progress_at))
        self._prefix_window.record(stats.prefix_hits_tokens, stats.prefix_queries_tokens)
        auto = engine.auto_defrag
        last_age = None if self._last_defrag_at is None else now - self._last_defrag_at
        runs = {trigger.value: auto.runs_total[trigger] for trigger in DefragTrigger}
        occupancy = occupancy_fields(pool)  # the pool's own reading: pages, runs, counters
        if self.sleep.holds_no_pages:
            occupancy |= dict.fromkeys(_HELD_BY_AWAKE_POOLS, 0)  # it holds no memory
        self.snapshot = PoolSnapshot(
            **occupancy,
            pool=self.name,
            timestamp=self.wall_clock(),
            device=str(engine.device),
            prompt_tokens_total=stats.prompt_tokens,
            generation_tokens_total=stats.generated_tokens,
            max_pool_pages=engine.resizer.max_pages,
            alloc_success_ratio=self._alloc_window.ratio(),
            window_seconds=self.window,
            prefix_cache_enabled=engine.config.prefix_cache,
            prefix_queries_tokens_total=stats.prefix_queries_tokens,
            prefix_hits_tokens_total=stats.prefix_hits_tokens,
            prefix_hit_ratio=self._prefix_window.ratio(),
            prefix_evictions_total=sum(stats.prefix_evictions.values()),
            prefix_hits_tokens_by_tier=stats.prefix_hits_by_tier,
            tiers=[tier_view(t) for t in stats.tiers],
            prefill_seconds_per_token=stats.prefill_seconds_per_token,
            defrag_runs_total=runs,
            defrag_pages_moved_total=auto.pages_moved_total,
            defrag_active=auto.active is not None,
            last_defrag=self._last_defrag,
            last_defrag_age_seconds=last_age,
            auto_defrag_enabled=auto.policy.enabled,
            resizes_total=dict(self.resizes_total),
            requests_running=stats.requests_running,
            requests_waiting=stats.requests_waiting,
            preemptions_total=stats.preemptions,
            page_groups=stats.page_groups,
            window_pages=stats.window_pages,
            window_released_pages_total=stats.window_released_pages,
            prefix_pins=len(engine.scheduler.pins),
            prefix_pinned_pages=engine.scheduler.pins.pinned_pages,
            prefix_pin_cap_pages=engine.prefix_ops.cap_pages if engine.prefix_ops else 0,
            token_slots_used=stats.token_slots_used,
            preemptions_by_reason_total=dict(stats.preemptions_by_reason),
            prefix_evictions_by_reason_total=dict(stats.prefix_evictions_by_reason),
            prefix_residency=residency_view(engine.prefix_cache.residency)
            if engine.prefix_cache is not None
            else {},
            alert_notifications_dropped_total=agent.alert_notifications_dropped_total,
            gpus=agent.gpus,
            max_waiting=self.max_waiting,
            oldest_waiting_seconds=waited,
            queue_stalled_seconds=stalled,
            window_alloc_attempts=attempts,
            window_alloc_failures=attempts - successes,
            requests_finished_total=dict(stats.finished),
            requests_rejected_total=self.rejected.read(),
            admin_actions_total=agent.admin_actions_total,
            share=agent.share,
            sleep=self.sleep.reading(),
        )
        return self.snapshot
