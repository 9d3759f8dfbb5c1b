"""The shape of an alert definition: one record the agent's evaluator and the rule file share.

An alert is written once: a measured value (a function of the agent's snapshot, and the same
quantity as PromQL over the agent's metrics), a threshold with a clear level (hysteresis), a
`for` duration, the texts, and an ordered list of causes. The agent reads its own state to pick
the first cause that applies; Prometheus, which sees only the metrics, gets the headline and a
generic remediation. Keeping both sides in one record is what keeps them from drifting apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvctl.api import AlertSettings, PoolSnapshot

Severity = Literal["info", "warning", "critical"]
SEVERITY_RANK: dict[str, int] = {"critical": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class Threshold:
    """A Schmitt trigger on one `AlertSettings` field.

    An alert becomes active when the value crosses the trigger, and once firing it stays firing
    until the value is back past the clear level (trigger ∓ margin), so a value hovering at the
    threshold does not page, resolve and page again. A pending alert needs the trigger condition
    to hold all through its `for` duration, as in Prometheus.
    """

    setting: str
    above: bool
    margin: float
    relative: bool = False  # margin is a share of the trigger, for unbounded rates
    bounded: bool = True  # a ratio: the clear level stays within 0..1

    def trigger(self, settings: AlertSettings) -> float:
        return float(getattr(settings, self.setting))

    def clear(self, settings: AlertSettings) -> float:
        trigger = self.trigger(settings)
        margin = self.margin * trigger if self.relative else self.margin
        level = trigger - margin if self.above else trigger + margin
        if self.bounded:
            level = min(1.0, level)
        return round(max(0.0, level), 6)

    @property
    def op(self) -> str:
        return ">" if self.above else "<"

    def breached(self, value: float, settings: AlertSettings) -> bool:
        return self._past(value, self.trigger(settings))

    def holds(self, value: float, settings: AlertSettings) -> bool:
        return self._past(value, self.clear(settings))

    def _past(self, value: float, level: float) -> bool:
        return value > level if self.above else value < level


@dataclass(frozen=True)
class Reading:
    """One measured value; `labels` tell apart several readings of one alert (one per GPU)."""

    value: float
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Observation:
    """What the evaluator knows at one evaluation: the snapshot and rates over its history."""

    snapshot: PoolSnapshot
    preemptions_per_minute: float | None = None


@dataclass(frozen=True)
class Situation:
    """What a cause reads: the snapshot, the reading that tripped, the thresholds, the agent."""

    snapshot: PoolSnapshot
    reading: Reading
    settings: AlertSettings
    agent_url: str

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.reading.labels)


@dataclass(frozen=True)
class Cause:
    """One likely cause: when it applies, how it reads, and what to run about it."""

    applies: Callable[[Situation], bool]
    explain: Callable[[Situation], str]
    remedy: Callable[[Situation], str]


def always(_: Situation) -> bool:
    """The last cause of every list: the explanation when nothing more specific applies."""
    return True


@dataclass(frozen=True)
class Fact:
    """A number a headline quotes: read from the snapshot by the agent, queried by Prometheus.

    `promql` is a query with `$SEL` where the alert's `instance` and `pool` matchers go.
    """

    get: Callable[[PoolSnapshot], float]
    promql: str
    format: str  # a key of kvctl.alerts.catalog.FORMATS


@dataclass(frozen=True)
class AlertDefinition:
    """One alert, evaluated by the agent and rendered into the Prometheus rule file.

    Text fields are `str.format` templates. `summary` may use `{pool}` and `{instance}`;
    `headline` and `rule_remediation` may also use `{value}`, `{agent}` (the agent's URL), the
    labels of the reading and the names of `catalog.FACTS`.
    """

    name: str
    severity: Severity
    summary: str
    threshold: Threshold
    measure: Callable[[Observation], list[Reading]]
    value_format: str
    promql: str
    headline: str
    causes: tuple[Cause, ...]
    rule_remediation: Callable[[AlertSettings], str]
    promql_gate: tuple[str, ...] = ()  # also required, joined with `and on(job, instance, pool)`
    for_scale: float = 1.0  # `for` = for_scale × AlertSettings.for_s
    labels: tuple[str, ...] = field(default=())  # label names a reading adds

    @property
    def anchor(self) -> str:
        """The runbook section's anchor: GitHub's slug of the `## Name` heading."""
        return self.name.lower()

    def for_seconds(self, settings: AlertSettings) -> float:
        return self.for_scale * settings.for_s

    def cause(self, situation: Situation) -> Cause:
        return next(c for c in self.causes if c.applies(situation))


@dataclass(frozen=True)
class RuleOnlyAlert:
    """An alert only Prometheus can raise (the agent cannot report its own absence).

    `expr` is a `str.format` template with `{job}`, the agents' scrape job.
    """

    name: str
    severity: Severity
    expr: str
    summary: str
    description: str
    remediation: str
    for_scale: float = 1.0

    @property
    def anchor(self) -> str:
        return self.name.lower()

    def for_seconds(self, settings: AlertSettings) -> float:
        return self.for_scale * settings.for_s
