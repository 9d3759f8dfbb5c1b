"""How long cached pages stay, and how soon they are used again: the prefix cache's residency,
as bucket counts the agent exports as Prometheus histograms.

- **lifetime**: from a page entering the cache to its eviction, per page evicted;
- **idle before eviction**: from a page's last use (a hit, or its insert) to its eviction, per
  page evicted: short idle times mean the cache is too small for its reuse distance;
- **reuse gap**: from a prefix's last use to a hit on it, per hit.

vLLM's `--kv-cache-metrics` samples 1 % of blocks behind a flag; these count every eviction and
every hit, always, at the granularity the cache keeps times at anyway (a tree node: the pages one
insert made, or a split left), so the cost is a clock read per hit and insert and an addition
per evicted leaf (docs/performance.md, "Residency histograms: their cost"). The sliding-window
groups' pages (held one by one) and purges (`PrefixCache.drop`) are not counted.

Plain counts, no Prometheus types: the core stays free of the exporter. The engine thread
writes; a scrape reads a copy, which may see one observation's count without its sum.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

RESIDENCY_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)
"""Seconds: from a burst's reuse (sub-second) to a day, the range vLLM's block metrics span."""


@dataclass
class DurationCounts:
    """Counts of durations per bucket (`bounds[i]` is an upper bound; the last count is
    +Inf) and their weighted sum."""

    bounds: tuple[float, ...] = RESIDENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float, weight: int = 1) -> None:
        """Count `weight` observations of `seconds` (clamped at 0: clocks of one process do not
        run backwards, but a node's time may be set in the same tick)."""
        seconds = max(0.0, seconds)
        self.counts[bisect_left(self.bounds, seconds)] += weight
        self.total += seconds * weight

    def cumulative(self) -> tuple[tuple[int, ...], float]:
        """The counts at or below each bound, +Inf last, and the sum: Prometheus' buckets."""
        counts, total = list(self.counts), self.total
        running, out = 0, []
        for n in counts:
            running += n
            out.append(running)
        return tuple(out), total


@dataclass
class Residency:
    """The three residency figures of one prefix cache."""

    lifetime: DurationCounts = field(default_factory=DurationCounts)
    idle_before_evict: DurationCounts = field(default_factory=DurationCounts)
    reuse_gap: DurationCounts = field(default_factory=DurationCounts)
