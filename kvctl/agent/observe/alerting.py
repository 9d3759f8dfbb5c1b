"""The agent's alert loop: evaluate the latest snapshots every interval, keep the result for
`GET /v1/alerts`, and keep Alertmanager in step when one is configured.

The evaluator gets the whole runtime settings in force at each evaluation, not only the alert
thresholds, so a remediation never suggests a setting that is already set.

It runs on its own thread because delivery is blocking HTTP with retries: an Alertmanager that is
down must never slow the engine. It only reads snapshots, so it needs no lock with the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from kvctl.alerts import AlertmanagerError, AlertmanagerNotifier
from kvctl.api import Alert, RuntimeSettings

log = logging.getLogger(__name__)
FLUSH_INTERVAL_S = 1.0

Readings = TypeVar("Readings")
Evaluated = TypeVar("Evaluated", contravariant=True)


class Evaluator(Protocol[Evaluated]):
    """What the loop needs of an evaluator: settings it can replace before each evaluation, and
    alerts from what it reads. `AlertEvaluator` reads one pool's snapshot, `PoolAlerts` every
    pool's."""

    @property
    def settings(self) -> RuntimeSettings: ...

    @settings.setter
    def settings(self, settings: RuntimeSettings) -> None: ...

    def evaluate(self, readings: Evaluated, /) -> list[Alert]: ...


class AlertLoop(Generic[Readings]):
    """Evaluates alerts every `settings().alerts.interval_s` and delivers them to Alertmanager;
    `snapshot()` gives what the evaluator reads."""

    def __init__(
        self,
        evaluator: Evaluator[Readings],
        snapshot: Callable[[], Readings],
        settings: Callable[[], RuntimeSettings],
        notifier: AlertmanagerNotifier | None = None,
        clock: Callable[[], float] = time.monotonic,
        send_test: Callable[[], dict] | None = None,
    ) -> None:
        self.evaluator = evaluator
        self.snapshot = snapshot
        self.settings = settings
        self.notifier = notifier
        self.clock = clock
        self._send_test = send_test
        self.alerts: list[Alert] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def dropped_total(self) -> int:
        return self.notifier.dropped_total if self.notifier else 0

    def send_test(self) -> dict:
        """Post a test alert to this agent's Alertmanager with its labels and credentials;
        returns the alert, raises AlertmanagerError (also when none is configured)."""
        if self._send_test is None:
            raise AlertmanagerError(
                "this agent sends no alerts: start it with --alertmanager-url to test the route"
            )
        return self._send_test()

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
                    next_evaluation += self.settings().alerts.interval_s
                    next_evaluation = max(next_evaluation, now)  # no burst after a stall
                elif self.notifier is not None:
                    self.notifier.flush()
            except Exception:  # an evaluation bug must not end alerting for good
                log.exception("alert evaluation failed")
            self._stop.wait(min(FLUSH_INTERVAL_S, max(0.0, next_evaluation - self.clock())))
