"""The agent's own alert evaluation: snapshots in, pending and firing alerts out.

It follows Prometheus' semantics, so an operator reads the agent's alerts like any other: an
alert is pending from the first evaluation its condition holds, firing once it has held for the
alert's `for` duration, and gone at the first evaluation it does not. Hysteresis is added on top:
a firing alert resolves only when its value is back past the clear level, a rate needs a minimum
count of events before it fires, and an escalated severity holds down to a looser level. Time
comes from an injected clock, so a test steps through minutes of alert history without sleeping.

Every alert carries the labels Prometheus would attach to a series it scraped from this agent
(`job`, and `instance` = the advertised host:port), so an alert about one node has one identity
wherever it is seen, and two nodes serving one model are two alerts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvctl import api
from kvctl.alerts.catalog import (
    AGENT_JOB,
    DEFINITIONS,
    FACTS,
    FORMATS,
    RUNBOOK_PATH,
    runbook_url,
)
from kvctl.alerts.definition import (
    SEVERITY_RANK,
    AlertDefinition,
    Observation,
    Reading,
    Severity,
    Situation,
    TierWindow,
)

PREEMPTION_WINDOW_S = 300.0
"""Preemptions per minute are averaged over 5 minutes, like the rule file's `rate(...[5m])`."""


class CounterRate:
    """Per-minute rate of a counter over a sliding window of (time, value) samples.

    One sample at or before the window's start is kept as the baseline, so the rate covers the
    whole window once there is that much history, and whatever history there is before that.
    """

    def __init__(self, window_s: float = PREEMPTION_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def update(self, now: float, total: int) -> float | None:
        """Record `total` at `now`; the rate per minute, or None with under two samples."""
        if self._samples and total < self._samples[-1][1]:
            self._samples.clear()  # the counter restarted
        self._samples.append((now, total))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        (t0, v0), (t1, v1) = self._samples[0], self._samples[-1]
        return None if t1 <= t0 else (v1 - v0) * 60.0 / (t1 - t0)


class CounterWindow:
    """Increases of several counters over a sliding window of (time, totals) samples.

    Like `CounterRate`, one sample at or before the window's start is kept as the baseline. The
    window is given at each update, so it follows the agent's stats window when that changes.
    A counter that went down (the totals restarted) starts the history again.
    """

    def __init__(self) -> None:
        self._samples: deque[tuple[float, dict[str, float]]] = deque()

    def update(
        self, now: float, totals: Mapping[str, float], window_s: float
    ) -> tuple[float, dict[str, float]] | None:
        """Record `totals` at `now`; the span covered and each counter's increase over it, or
        None with under two samples."""
        if self._samples:
            last = self._samples[-1][1]
            if any(totals.get(name, 0) < value for name, value in last.items()):
                self._samples.clear()
        self._samples.append((now, dict(totals)))
        while len(self._samples) > 2 and self._samples[1][0] <= now - window_s:
            self._samples.popleft()
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        if t1 <= t0:
            return None
        return t1 - t0, {name: value - first.get(name, 0) for name, value in last.items()}


_FAILED = "store_failures."


def _tier_totals(tier: api.TierReading) -> dict[str, float]:
    totals: dict[str, float] = {
        "stored_pages": tier.stored_pages_total,
        "loaded_pages": tier.loaded_pages_total,
        "hits_tokens": tier.hits_tokens_total,
        "load_seconds": tier.load_seconds_total,
    }
    totals.update({_FAILED + r: n for r, n in tier.store_failures_total.items()})
    return totals


class TierHistory:
    """Each tier's counters over the agent's stats window (`window_seconds`), from the
    snapshots the evaluator sees, so the tier alerts read rates, not totals since start."""

    def __init__(self) -> None:
        self._windows: dict[str, CounterWindow] = {}

    def update(self, now: float, snapshot: api.PoolSnapshot) -> dict[str, TierWindow]:
        """Record this snapshot's tiers; what each did over the window (tiers with under two
        samples are left out, and a tier gone from the snapshot loses its history)."""
        out: dict[str, TierWindow] = {}
        listed = {tier.tier for tier in snapshot.tiers}
        for name in self._windows.keys() - listed:
            del self._windows[name]
        for tier in snapshot.tiers:
            window = self._windows.setdefault(tier.tier, CounterWindow())
            changed = window.update(now, _tier_totals(tier), snapshot.window_seconds)
            if changed is None:
                continue
            seconds, increase = changed
            out[tier.tier] = TierWindow(
                tier=tier.tier,
                seconds=seconds,
                stored_pages=int(increase["stored_pages"]),
                loaded_pages=int(increase["loaded_pages"]),
                hits_tokens=int(increase["hits_tokens"]),
                load_seconds=max(0.0, increase["load_seconds"]),
                store_failures={
                    name.removeprefix(_FAILED): int(n)
                    for name, n in increase.items()
                    if name.startswith(_FAILED)
                },
            )
        return out


@dataclass
class _State:
    active_since: float
    firing: bool = False
    escalated: bool = False


class _Values(dict):
    """The fields of an alert's text templates; facts are read from the snapshot on demand."""

    def __init__(self, snapshot: api.PoolSnapshot, **known: str) -> None:
        super().__init__(known)
        self.snapshot = snapshot

    def __missing__(self, key: str) -> str:
        fact = FACTS[key]
        return FORMATS[fact.format][0](fact.get(self.snapshot))


def runtime_settings(settings: api.RuntimeSettings | api.AlertSettings) -> api.RuntimeSettings:
    """The settings in force; thresholds alone mean every other setting is at its default."""
    if isinstance(settings, api.AlertSettings):
        return api.RuntimeSettings(alerts=settings)
    return settings


class AlertEvaluator:
    """Evaluates every alert of `definitions` on each snapshot of one pool.

    `evaluate` is called once per alert interval; the alerts it returns are the pending and
    firing ones, most severe first. `settings` (the agent's runtime settings, or only the alert
    thresholds) may be replaced between calls (PATCH /v1/config); active alerts keep their
    state. `agent_url` is the URL in remediation commands and `instance` its host:port;
    `runbook_base` defaults to the runbook the agent serves at `<agent_url>/runbook`.
    """

    def __init__(
        self,
        settings: api.RuntimeSettings | api.AlertSettings,
        pool: str,
        instance: str,
        clock: Callable[[], float] = time.time,
        *,
        agent_url: str | None = None,
        job: str = AGENT_JOB,
        runbook_base: str | None = None,
        definitions: Sequence[AlertDefinition] = DEFINITIONS,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.instance = instance
        self.clock = clock
        self.agent_url = agent_url or f"http://{instance}"
        self.job = job
        self.runbook_base = runbook_base or f"{self.agent_url}{RUNBOOK_PATH}"
        self.definitions = tuple(definitions)
        self._states: dict[tuple[str, tuple[tuple[str, str], ...]], _State] = {}
        self._preemptions = CounterRate()
        self._tiers = TierHistory()
        self.alerts: list[api.Alert] = []

    @property
    def settings(self) -> api.RuntimeSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: api.RuntimeSettings | api.AlertSettings) -> None:
        self._settings = runtime_settings(settings)

    @property
    def thresholds(self) -> api.AlertSettings:
        return self._settings.alerts

    def evaluate(self, snapshot: api.PoolSnapshot) -> list[api.Alert]:
        """The alerts active after this snapshot (also kept in `self.alerts`)."""
        now = self.clock()
        rate = self._preemptions.update(now, snapshot.preemptions_total)
        tiers = self._tiers.update(now, snapshot)
        observation = Observation(snapshot, preemptions_per_minute=rate, tiers=tiers)
        alerts, seen = [], set()
        for definition in self.definitions:
            for reading in definition.measure(observation):
                key = (definition.name, reading.labels)
                seen.add(key)
                state = self._advance(definition, key, reading, now)
                if state is not None:
                    severity = self._severity(definition, state, snapshot)
                    alerts.append(self._alert(definition, reading, state, severity, observation))
        for key in self._states.keys() - seen:
            del self._states[key]
        alerts.sort(key=lambda a: (SEVERITY_RANK[a.severity], a.name, sorted(a.labels.items())))
        self.alerts = alerts
        return alerts

    def _advance(
        self, definition: AlertDefinition, key: tuple, reading: Reading, now: float
    ) -> _State | None:
        """Move one alert's state machine by one evaluation; None when it is not active."""
        state, threshold, minimum = self._states.get(key), definition.threshold, definition.minimum
        if state is not None and state.firing:
            keep = threshold.holds(reading.value, self.thresholds)
            keep = keep and (minimum is None or minimum.left(reading))
        else:
            keep = threshold.breached(reading.value, self.thresholds)
            keep = keep and (minimum is None or minimum.reached(reading, self.thresholds))
        if not keep:
            self._states.pop(key, None)
            return None
        if state is None:
            state = self._states[key] = _State(active_since=now)
        if now - state.active_since >= definition.for_seconds(self.thresholds):
            state.firing = True
        return state

    def _severity(
        self, definition: AlertDefinition, state: _State, snapshot: api.PoolSnapshot
    ) -> Severity:
        """The alert's severity now: escalated while its escalation holds."""
        escalation = definition.escalation
        if escalation is None:
            return definition.severity
        check = escalation.holds if state.escalated else escalation.trigger
        state.escalated = check(snapshot, self.thresholds)
        return escalation.severity if state.escalated else definition.severity

    def _alert(
        self,
        definition: AlertDefinition,
        reading: Reading,
        state: _State,
        severity: Severity,
        observation: Observation,
    ) -> api.Alert:
        snapshot = observation.snapshot
        situation = Situation(
            snapshot, reading, self.settings, self.agent_url, tiers=observation.tiers
        )
        cause = definition.cause(situation)
        values = _Values(
            snapshot,
            value=FORMATS[definition.value_format][0](reading.value),
            pool=self.pool,
            instance=self.instance,
            agent=self.agent_url,
            **dict(reading.labels),
        )
        headline = definition.headline.format_map(values)
        labels = {
            "alertname": definition.name,
            "severity": severity,
            "pool": self.pool,
            "instance": self.instance,
            "job": self.job,
            **dict(reading.labels),
        }
        return api.Alert(
            name=definition.name,
            severity=severity,
            state="firing" if state.firing else "pending",
            value=reading.value,
            summary=definition.summary.format_map(values),
            description=f"{headline}; {cause.explain(situation)}",
            remediation=cause.remedy(situation),
            runbook_url=runbook_url(self.runbook_base, definition.anchor),
            active_since=state.active_since,
            labels=labels,
        )


class PoolAlerts:
    """The alerts of an agent's pools (one per served model): one `AlertEvaluator` per pool,
    each with its own history, evaluated together over the pools' snapshots."""

    def __init__(self, evaluators: Sequence[AlertEvaluator]) -> None:
        if not evaluators:
            raise ValueError("an agent has at least one pool")
        self.evaluators = {evaluator.pool: evaluator for evaluator in evaluators}
        first = evaluators[0]
        self.instance, self.job = first.instance, first.job
        self.alerts: list[api.Alert] = []

    @property
    def settings(self) -> api.RuntimeSettings:
        return next(iter(self.evaluators.values())).settings

    @settings.setter
    def settings(self, settings: api.RuntimeSettings | api.AlertSettings) -> None:
        for evaluator in self.evaluators.values():
            evaluator.settings = settings

    def evaluate(self, snapshots: Sequence[api.PoolSnapshot]) -> list[api.Alert]:
        """Every pool's active alerts, most severe first (a pool without a snapshot, or gone
        from the list, keeps its history for when it is back)."""
        alerts = [
            alert
            for snapshot in snapshots
            if (evaluator := self.evaluators.get(snapshot.pool)) is not None
            for alert in evaluator.evaluate(snapshot)
        ]
        alerts.sort(key=lambda a: (SEVERITY_RANK[a.severity], a.name, sorted(a.labels.items())))
        self.alerts = alerts
        return alerts
