"""Counts by key, added to from any thread (HTTP handlers and the engine)."""

from __future__ import annotations

import threading
from collections import Counter


class Tally:
    """Counts by key under a lock: refusals by reason, audited actions by kind."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def read(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
