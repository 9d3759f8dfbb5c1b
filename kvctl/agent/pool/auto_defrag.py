"""When to defragment: the triggers (docs/architecture.md) turned into budgeted steps.

A *session* starts on a trigger (manual, fragmentation above threshold, too many free extents,
a request that wanted a contiguous run and got scattered pages, a shrink) and then advances a
little on every engine step (`tick`), bounded by pages and seconds, until the pool is compact
enough. Stopping at a lower fragmentation than the one that started it (hysteresis) keeps a pool
that hovers around the threshold from defragmenting on and off.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from collections.abc import Callable

from kvctl.agent.pool.defrag import Defragmenter, DefragReport, DefragTrigger
from kvctl.settings import DefragSettings

SessionListener = Callable[[DefragReport], None]


class AutoDefrag:
    """Starts defragmentation sessions on triggers and advances them under a per-tick budget."""

    def __init__(
        self,
        defragmenter: Defragmenter,
        policy: DefragSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        history: int = 32,
    ) -> None:
        self.defragmenter = defragmenter
        self.policy = policy or DefragSettings()
        self.clock = clock
        self.active: DefragReport | None = None  # the running session, accumulated
        self.completed: deque[DefragReport] = deque(maxlen=history)
        self.runs_total: Counter[DefragTrigger] = Counter()
        self.pages_moved_total = 0
        self._listeners: list[SessionListener] = []
        self._next_check = clock()
        self._misses_seen = defragmenter.pool.contiguous_misses

    def add_listener(self, listener: SessionListener) -> None:
        """Be told of every finished session (automatic, manual or a shrink's evacuation)."""
        self._listeners.append(listener)

    def run_now(self, trigger: DefragTrigger, max_pages: int | None = None) -> DefragReport:
        """Defragment at once, to completion or `max_pages`, and count it as a session."""
        report = self.defragmenter.run(trigger, max_pages=max_pages)
        self.record(report)
        return report

    def record(self, report: DefragReport) -> None:
        """Count a defragmentation that ran outside the automatic sessions."""
        self.runs_total[report.trigger] += 1
        self.pages_moved_total += report.pages_moved
        self._finish(report)

    def due_trigger(self) -> DefragTrigger | None:
        """The trigger that should start a session now, if any (checks thresholds when due)."""
        pool, policy = self.defragmenter.pool, self.policy
        misses = pool.contiguous_misses
        missed = misses > self._misses_seen
        self._misses_seen = misses
        if not policy.enabled:
            return None
        if missed and policy.on_contiguous_miss:
            return DefragTrigger.ALLOC_FAILURE
        now = self.clock()
        if now < self._next_check:
            return None
        self._next_check = now + policy.check_interval_s
        stats = pool.stats()
        if stats.free_pages < policy.min_free_pages:
            return None
        if stats.fragmentation_ratio > policy.fragmentation_threshold:
            return DefragTrigger.THRESHOLD
        if stats.free_extents > policy.max_free_extents:
            return DefragTrigger.EXTENTS
        return None

    def tick(self) -> DefragReport | None:
        """Advance the session (starting one if a trigger is due); return this tick's work."""
        session = self.active
        if session is None:
            trigger = self.due_trigger()
            if trigger is None:
                return None
            session = self.active = self._start(trigger)
        report = self.defragmenter.run(
            session.trigger,
            max_pages=self.policy.step_max_pages,
            max_seconds=self.policy.step_max_seconds,
        )
        self._accumulate(session, report)
        return report

    def _start(self, trigger: DefragTrigger) -> DefragReport:
        stats = self.defragmenter.pool.stats()
        self.runs_total[trigger] += 1
        return DefragReport(
            trigger=trigger,
            fragmentation_before=stats.fragmentation_ratio,
            fragmentation_after=stats.fragmentation_ratio,
            free_extents_before=stats.free_extents,
            free_extents_after=stats.free_extents,
            pages_moved=0,
            bytes_moved=0,
            seconds=0.0,
            complete=False,
        )

    def _accumulate(self, started: DefragReport, report: DefragReport) -> None:
        """Add one tick's `report` to the session so far (`started`); end it when done."""
        self.pages_moved_total += report.pages_moved
        session = dataclasses.replace(
            started,
            fragmentation_after=report.fragmentation_after,
            free_extents_after=report.free_extents_after,
            pages_moved=started.pages_moved + report.pages_moved,
            bytes_moved=started.bytes_moved + report.bytes_moved,
            seconds=started.seconds + report.seconds,
            complete=report.complete,
        )
        compact_enough = (
            report.fragmentation_after <= self.policy.fragmentation_target
            and report.free_extents_after <= self.policy.max_free_extents
        )
        if report.complete or compact_enough:
            self.active = None
            self._finish(session)
        else:
            self.active = session

    def _finish(self, session: DefragReport) -> None:
        self.completed.append(session)
        for listener in self._listeners:
            listener(session)
