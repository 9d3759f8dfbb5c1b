"""The four headline numbers of one agent over the whole session, in bounded memory.

Recent readings are kept as they came; older ones are merged into coarser buckets, level by
level (each level `factor` times coarser than the one below and at most `level_size` long), so
a week of one-second polls costs a few thousand buckets, and the last minutes stay at full
resolution. A bucket keeps the *worst* value of each number (lowest success and prefix hit
rate, highest fragmentation and utilisation): a one-poll dip in allocation success stays
visible in the hour-long view instead of being averaged away.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvctl.api import PoolSnapshot
from kvctl.view.tiers import TierRates, tier_rates

SERIES = ("alloc_success_ratio", "fragmentation_ratio", "utilization_ratio", "prefix_hit_ratio")
WORST: dict[str, Callable[[float, float], float]] = {
    "alloc_success_ratio": min,
    "fragmentation_ratio": max,
    "utilization_ratio": max,
    "prefix_hit_ratio": min,
}


@dataclass(frozen=True)
class Window:
    """A span of time the sparklines show: the last `seconds`, or the session when None."""

    label: str
    seconds: float | None


WINDOWS = (Window("1m", 60.0), Window("10m", 600.0), Window("1h", 3600.0), Window("session", None))


@dataclass(frozen=True, slots=True)
class Bucket:
    """Readings from `start` to `end` (one reading: start == end), worst value per series."""

    start: float
    end: float
    values: tuple[float | None, ...]


def _worse(name: str, a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return WORST[name](a, b)


def _merge(buckets: list[Bucket]) -> Bucket:
    values = list(buckets[0].values)
    for bucket in buckets[1:]:
        values = [_worse(n, v, w) for n, v, w in zip(SERIES, values, bucket.values, strict=True)]
    return Bucket(buckets[0].start, buckets[-1].end, tuple(values))


class History:
    """Every reading of the session, downsampled with age; drawn as bars over a time window.

    A reading stands for the time since the reading before it (the agent's ratios cover a
    trailing window), where that is at most `hold` seconds (a little more than the poll
    interval): a longer silence, an agent that did not answer, is a gap in the sparkline.
    """

    def __init__(self, hold: float = 2.0, level_size: int = 256, factor: int = 4) -> None:
        self.hold = hold
        self.level_size = level_size
        self.factor = factor
        self._levels: list[deque[Bucket]] = [deque()]
        self._count = 0

    def add(self, pool: PoolSnapshot, at: float) -> None:
        """Record `pool`'s four numbers as read at time `at` (seconds, never decreasing)."""
        self._levels[0].append(Bucket(at, at, tuple(getattr(pool, name) for name in SERIES)))
        self._count += 1
        for level, buckets in enumerate(self._levels):
            while len(buckets) > self.level_size:
                merged = _merge([buckets.popleft() for _ in range(self.factor)])
                if level + 1 == len(self._levels):
                    self._levels.append(deque())
                self._levels[level + 1].append(merged)

    def buckets(self) -> list[Bucket]:
        """All buckets, oldest first."""
        return [bucket for level in reversed(self._levels) for bucket in level]

    @property
    def start(self) -> float | None:
        """When the first reading of the session was taken."""
        for level in reversed(self._levels):
            if level:
                return level[0].start
        return None

    def bars(self, name: str, width: int, now: float, window: float | None) -> list[float | None]:
        """`width` values, oldest first, for equal slices of the last `window` seconds before
        `now` (of the whole session when None): the worst reading in each slice, None where
        there was none."""
        bars: list[float | None] = [None] * max(0, width)
        buckets = self.buckets()
        if not bars or not buckets:
            return bars
        index = SERIES.index(name)
        start = buckets[0].start if window is None else now - window
        span = now - start
        if span <= 0:
            bars[-1] = buckets[-1].values[index]
            return bars
        step = span / width
        previous: Bucket | None = None
        for bucket in buckets:
            begin, end = bucket.start, bucket.end
            if previous is not None and begin - previous.end <= self.hold:
                begin = previous.end  # a reading stands for the time since the one before
            if bucket is buckets[-1] and now - end <= self.hold:
                end = now  # and the latest for the present, until the next poll is due
            previous = bucket
            if end < start:
                continue
            first = min(width - 1, max(0, math.floor((begin - start) / step)))
            last = min(width - 1, max(first, math.ceil((end - start) / step) - 1))
            for slot in range(first, last + 1):
                bars[slot] = _worse(name, bars[slot], bucket.values[index])
        return bars

    def __len__(self) -> int:
        """Readings recorded this session (not the buckets they are kept in)."""
        return self._count


RATE_SECONDS = 10.0
"""The span rates are taken over: steadier than between two polls, still close to now."""


class RateWindow:
    """The readings of one agent over the last `seconds` of its own clock, for per-second rates
    (prefill saved, bytes loaded from each tier) between the oldest and the newest."""

    def __init__(self, seconds: float = RATE_SECONDS) -> None:
        self.seconds = seconds
        self._readings: deque[PoolSnapshot] = deque()

    def add(self, pool: PoolSnapshot) -> None:
        """Keep `pool`; a reading from the same instant replaces the last one, and a counter
        that went back (the agent restarted) starts the window again."""
        if self._readings:
            last = self._readings[-1]
            if pool.prefix_hits_tokens_total < last.prefix_hits_tokens_total:
                self._readings.clear()
            elif pool.timestamp <= last.timestamp:
                self._readings.pop()
        self._readings.append(pool)
        while len(self._readings) > 2 and pool.timestamp - self._readings[1].timestamp >= (
            self.seconds
        ):
            self._readings.popleft()

    def rates(self) -> TierRates | None:
        """Rates between the oldest and the newest reading kept; None before two readings."""
        if len(self._readings) < 2:
            return None
        return tier_rates(self._readings[0], self._readings[-1])
