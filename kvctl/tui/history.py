"""The recent values of the four headline numbers of one agent, for the sparklines."""

from __future__ import annotations

from collections import deque

from kvctl.api import PoolSnapshot

SERIES = ("alloc_success_ratio", "fragmentation_ratio", "utilization_ratio", "prefix_hit_ratio")


class History:
    """The last `length` readings of each headline ratio (None where nothing was measured)."""

    def __init__(self, length: int = 240) -> None:
        self._series: dict[str, deque[float | None]] = {
            name: deque(maxlen=length) for name in SERIES
        }

    def add(self, pool: PoolSnapshot) -> None:
        for name, values in self._series.items():
            values.append(getattr(pool, name))

    def values(self, name: str) -> list[float | None]:
        return list(self._series[name])

    def __len__(self) -> int:
        return len(self._series[SERIES[0]])
