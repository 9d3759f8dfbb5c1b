"""The agent's alert loop: evaluate the latest snapshot every interval, keep the result for
`GET /v1/alerts`, and keep Alertmanager in step when one is configured.

It runs on its own thread because delivery is blocking HTTP with retries: an Alertmanager that is
down must never slow the engine. It only reads snapshots, so it needs no lock with the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvctl.alerts import AlertEvaluator, AlertmanagerNotifier
from kvctl.api import Alert, AlertSettings, PoolSnapshot

log = logging.getLogger(__name__)
FLUSH_INTERVAL_S = 1.0


class AlertLoop:
    """Evaluates alerts every `settings().interval_s` and delivers them to Alertmanager."""

    def __init__(
        self,
        evaluator: AlertEvaluator,
        snapshot: Callable[[], PoolSnapshot],
        settings: Callable[[], AlertSettings],
        notifier: AlertmanagerNotifier | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.evaluator = evaluator
        self.snapshot = snapshot
        self.settings = settings
        self.notifier = notifier
        self.clock = clock
        self.alerts: list[Alert] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def dropped_total(self) -> int:
        return self.notifier.dropped_total if self.notifier else 0

    def evaluate_once(self) -> list[Alert]:
        """One evaluation (and delivery); the loop calls this every interval."""
        self.evaluator.settings = self.settings()
        self.alerts = self.evaluator.evaluate(self.snapshot())
        if self.notifier is not None:
            self.notifier.sync(self.alerts)
        return self.alerts

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvctl-alerts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.notifier is not None:
            self.notifier.close()

    def _run(self) -> None:
        next_evaluation = self.clock()
        while not self._stop.is_set():
            now = self.clock()
            try:
                if now >= next_evaluation:
                    self.evaluate_once()
                    next_evaluation += self.settings().interval_s
                    next_evaluation = max(next_evaluation, now)  # no burst after a stall
                elif self.notifier is not None:
                    self.notifier.flush()
            except Exception:  # an evaluation bug must not end alerting for good
                log.exception("alert evaluation failed")
            self._stop.wait(min(FLUSH_INTERVAL_S, max(0.0, next_evaluation - self.clock())))
