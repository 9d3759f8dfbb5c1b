"""The shape of an alert definition: one record per alert, each owned by one evaluator.

An alert the agent owns (`AlertDefinition`) is a measured value (a function of the agent's
snapshot), a threshold with a clear level (hysteresis), an optional minimum count of events
behind the value, an optional escalation to a higher severity, a `for` duration, the texts, and
an ordered list of causes. The agent reads its own state, and the settings in force, to pick the
first cause that applies. An alert only Prometheus can raise (`RuleOnlyAlert`: an agent down or
absent, a fleet aggregate) is a PromQL expression rendered into the rule file. No alert is both,
so nothing reaches Alertmanager twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvctl.api import AlertSettings, PoolSnapshot, RuntimeSettings

Severity = Literal["info", "warning", "critical"]
SEVERITY_RANK: dict[str, int] = {"critical": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class Threshold:
    """A Schmitt trigger on one `AlertSettings` field.

    An alert becomes active when the value crosses the trigger, and once firing it stays firing
    until the value is back past the clear level (trigger ∓ margin), so a value hovering at the
    threshold does not page, resolve and page again. A pending alert needs the trigger condition
    to hold all through its `for` duration, as in Prometheus. A trigger no value can cross (a
    minimum of 0, a bounded maximum of 1) turns the alert off, and clears it if it was active.
    """

    setting: str
    above: bool
    margin: float
    relative: bool = False  # margin is a share of the trigger, for unbounded values
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

    def off(self, settings: AlertSettings) -> bool:
        """Whether the trigger is set where no value can cross it."""
        trigger = self.trigger(settings)
        return trigger >= 1.0 and self.bounded if self.above else trigger <= 0.0

    def breached(self, value: float, settings: AlertSettings) -> bool:
        return not self.off(settings) and self._past(value, self.trigger(settings))

    def holds(self, value: float, settings: AlertSettings) -> bool:
        return not self.off(settings) and self._past(value, self.clear(settings))

    def _past(self, value: float, level: float) -> bool:
        return value > level if self.above else value < level


@dataclass(frozen=True)
class Reading:
    """One measured value; `labels` tell apart several readings of one alert (one per GPU).

    `count` is the number of events behind a rate (failed allocations in the window), when the
    alert needs a minimum of them before it fires.
    """

    value: float
    labels: tuple[tuple[str, str], ...] = ()
    count: int | None = None


@dataclass(frozen=True)
class TierWindow:
    """What one tier below the device pool did over the window: the increases of its counters
    between the evaluator's snapshots, since a snapshot holds only totals since start."""

    tier: str
    seconds: float
    """The span the increases cover (the window, or less history when that is all there is)."""
    stored_pages: int = 0
    loaded_pages: int = 0
    hits_tokens: int = 0
    load_seconds: float = 0.0
    store_failures: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    """What the evaluator knows at one evaluation: the snapshot and rates over its history."""

    snapshot: PoolSnapshot
    preemptions_per_minute: float | None = None
    tiers: Mapping[str, TierWindow] = field(default_factory=dict)
    """Each tier's counters over the window, by tier name; a tier with under two snapshots of
    history has none yet."""


@dataclass(frozen=True)
class Situation:
    """What a cause reads: the snapshot, the reading that tripped, the settings in force (so a
    remedy never suggests what is already set), and the agent's URL for commands."""

    snapshot: PoolSnapshot
    reading: Reading
    runtime: RuntimeSettings
    agent_url: str
    tiers: Mapping[str, TierWindow] = field(default_factory=dict)
    """What each tier did over the window (see `Observation.tiers`)."""

    @property
    def settings(self) -> AlertSettings:
        """The alert thresholds in force."""
        return self.runtime.alerts

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
class MinimumCount:
    """A rate fires only with enough events behind it, so one event never pages.

    `setting` names the `AlertSettings` field with the minimum. Once firing, the alert holds
    while at least one event is left in the window, so a count hovering at the minimum does not
    flap.
    """

    setting: str

    def reached(self, reading: Reading, settings: AlertSettings) -> bool:
        return (reading.count or 0) >= int(getattr(settings, self.setting))

    @staticmethod
    def left(reading: Reading) -> bool:
        return (reading.count or 0) > 0


@dataclass(frozen=True)
class Escalation:
    """A higher severity of an active alert, with its own trigger and hold condition.

    Alertmanager identifies an alert by its labels, severity included, so an escalated alert is
    a new alert there: the evaluator's alert changes severity and the notifier resolves the old
    label set and fires the new one. The hold condition is looser than the trigger, so the
    severity does not flap either.
    """

    severity: Severity
    trigger: Callable[[PoolSnapshot, AlertSettings], bool]
    holds: Callable[[PoolSnapshot, AlertSettings], bool]


@dataclass(frozen=True)
class Fact:
    """A number a headline quotes, read from the snapshot, with the name of its format."""

    get: Callable[[PoolSnapshot], float]
    format: str  # a key of kvctl.alerts.catalog.FORMATS


@dataclass(frozen=True)
class AlertDefinition:
    """One alert the agent evaluates from its own state and pushes to Alertmanager.

    Text fields are `str.format` templates. `summary` may use `{pool}` and `{instance}`;
    `headline` may also use `{value}`, `{agent}` (the agent's URL), the labels of the reading
    and the names of `catalog.FACTS`.
    """

    name: str
    severity: Severity
    summary: str
    threshold: Threshold
    measure: Callable[[Observation], list[Reading]]
    value_format: str
    headline: str
    causes: tuple[Cause, ...]
    for_scale: float = 1.0  # `for` = for_scale × AlertSettings.for_s
    labels: tuple[str, ...] = field(default=())  # label names a reading adds
    minimum: MinimumCount | None = None
    escalation: Escalation | None = None

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
    """An alert only Prometheus can raise: what an agent cannot say about itself (its own
    absence) and what needs several agents (a fleet aggregate).

    `expr` is a `str.format` template with `{job}` (the agents' scrape job) and the names of
    the `AlertSettings` fields. The texts are `str.format` templates whose fields become labels
    of the alert in Prometheus' templates (`{instance}`, `{pool}`, `{job}`), `{value}` (in
    `value_format`) and `{agent}` (the agent's URL, `http://` + instance).
    """

    name: str
    severity: Severity
    expr: str
    summary: str
    description: str
    remediation: str
    for_scale: float = 1.0
    value_format: str = "count"

    @property
    def anchor(self) -> str:
        return self.name.lower()

    def for_seconds(self, settings: AlertSettings) -> float:
        return self.for_scale * settings.for_s
