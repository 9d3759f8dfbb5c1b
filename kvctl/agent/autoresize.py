"""When to grow or shrink the pool on its own.

Grow by one segment when utilisation has stayed above the high-water mark for a whole window
(and the pool is below its maximum, and the device has memory to spare); shrink by one segment
when it has stayed below the low-water mark for a whole window (down to the minimum). Requiring
the whole window, and then starting the window again after each resize, keeps a pool whose load
moves around a mark from resizing back and forth.
"""

from __future__ import annotations

from collections.abc import Callable

from kvctl.agent.pool.stats import PoolOccupancy
from kvctl.api import ResizeSettings


class AutoResize:
    """Decides a target capacity from successive pool readings; the clock is injected."""

    def __init__(self, settings: ResizeSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        self._above_since: float | None = None
        self._below_since: float | None = None

    def update_settings(self, settings: ResizeSettings) -> None:
        self.settings = settings
        self._above_since = self._below_since = None

    def decide(
        self, stats: PoolOccupancy, spare_bytes: int | None = None, promised: int = 0
    ) -> int | None:
        """The capacity to resize to now, or None. `spare_bytes` is free device memory (None:
        unknown, e.g. on a CPU host, where only the configured maximum limits growth);
        `promised` is the most pages an admitted request may still need (never shrink below)."""
        s = self.settings
        if not s.enabled:
            return None
        now = self.clock()
        utilization = stats.utilization_ratio
        self._above_since = _since(self._above_since, now, utilization > s.high_water)
        self._below_since = _since(self._below_since, now, utilization < s.low_water)
        segment = stats.segment_pages
        if self._above_since is not None and now - self._above_since >= s.window_s:
            target = stats.capacity_pages + segment
            room = spare_bytes is None or spare_bytes >= segment * stats.bytes_per_page
            if (s.max_pages is None or target <= s.max_pages) and room:
                self._above_since = None
                return target
        if self._below_since is not None and now - self._below_since >= s.window_s:
            target = stats.capacity_pages - segment
            floor = max(s.min_pages or segment, stats.used_pages + stats.cached_pages, promised)
            if target >= floor:
                self._below_since = None
                return target
        return None


def _since(started: float | None, now: float, holds: bool) -> float | None:
    """When the condition began to hold without a break (None while it does not hold)."""
    if not holds:
        return None
    return now if started is None else started
