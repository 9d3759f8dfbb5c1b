"""Ratios of two counters over a sliding time window (allocation success, prefix hit rate).

Counters only grow, so the ratio over the last `window` seconds is the ratio of their increases
since the oldest sample still inside the window. Samples are taken whenever the agent publishes
a snapshot; old ones are dropped, and the clock is a parameter so tests control time exactly.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class CounterRatioWindow:
    """`(Δ numerator) / (Δ denominator)` over the last `window` seconds, or None if Δ is 0."""

    def __init__(
        self,
        window: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        resolution: float = 1.0,
    ) -> None:
        if window <= 0 or resolution <= 0:
            raise ValueError(f"window and resolution must be positive, got {window}, {resolution}")
        self.window = window
        self.resolution = resolution
        self.clock = clock
        # (time, numerator, denominator); counters start at zero when the window is made
        self._samples: deque[tuple[float, int, int]] = deque([(clock(), 0, 0)])

    def record(self, numerator: int, denominator: int) -> None:
        """Add a reading of both counters (taken now); readings closer together than
        `resolution` replace each other, so memory stays bounded however often this is called."""
        now = self.clock()
        if len(self._samples) > 1 and now - self._samples[-2][0] < self.resolution:
            self._samples[-1] = (now, numerator, denominator)
        else:
            self._samples.append((now, numerator, denominator))
        # keep one sample at or before the window's start as the baseline
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()

    def increases(self) -> tuple[int, int]:
        """How much the numerator and the denominator grew within the window."""
        _, num0, den0 = self._samples[0]
        _, num1, den1 = self._samples[-1]
        return num1 - num0, den1 - den0

    def ratio(self) -> float | None:
        numerator, denominator = self.increases()
        return numerator / denominator if denominator else None
