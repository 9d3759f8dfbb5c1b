"""The agent's Prometheus metrics: one table of definitions, read at scrape time.

Every `kvctl_*` series is declared once, in `METRICS` (name, type, help, labels, getter), and
nothing else names a metric: the collector builds its families from the table, docs/metrics.md
is generated from it (`python -m kvctl.agent.observe.metrics_docs`), and the alert rules use
its names.

Nothing is updated on the hot path. A scrape takes one immutable `PoolSnapshot` (whose pool
statistics the pool keeps incrementally, so reading them is O(1) at any pool size) plus a copy of
the defrag-duration histogram (and the alert loop's current list and the KV-events publisher's
counters, each a plain read), and turns them into families. Hence the rules of docs/metrics.md
hold by construction: every series carries `pool`; a getter that returns None (a window with
nothing in it, no GPU, no limit set) leaves its series out instead of exporting a sentinel;
counters are built without a creation time, so no `_created` series appear."""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from operator import attrgetter
from typing import Literal, Protocol, get_args

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvctl import __version__
from kvctl.agent.pool.defrag import DefragTrigger
from kvctl.agent.prefix.prefix_cache import EVICTION_REASONS
from kvctl.agent.prefix.residency import DurationCounts, Residency
from kvctl.agent.runtime.scheduler import PREEMPTION_REASONS
from kvctl.agent.tiers import LOAD_FAILURES, STORE_FAILURES, TIER_NAMES
from kvctl.api import (
    AdminAction,
    Alert,
    FinishReasonName,
    PoolShare,
    PoolSnapshot,
    RejectReason,
    SleepTrigger,
    TierReading,
    WakeTrigger,
)

MetricType = Literal["gauge", "counter", "histogram"]

# Upper bounds (seconds) of `kvctl_defrag_duration_seconds`: from a single-batch run inside one
# decode step's budget (~1 ms) to a full compaction of a large pool spread over many steps.
# fmt: off
DEFRAG_DURATION_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
# fmt: on

RESIZE_DIRECTIONS: tuple[str, ...] = ("grow", "shrink")
REBALANCE_DIRECTIONS: tuple[str, ...] = ("in", "out")
FINISH_REASONS: tuple[str, ...] = get_args(FinishReasonName)
REJECT_REASONS: tuple[str, ...] = get_args(RejectReason)
ADMIN_ACTIONS: tuple[str, ...] = get_args(AdminAction)
SLEEP_TRIGGERS: tuple[str, ...] = get_args(SleepTrigger)
WAKE_TRIGGERS: tuple[str, ...] = get_args(WakeTrigger)


# ---- the defrag-duration accumulator ----------------------------------------------------------


@dataclass(frozen=True)
class HistogramReading:
    """A consistent copy of a histogram: `cumulative[i]` counts observations <= `bounds[i]`, and
    the last entry (one more than `bounds`) counts all of them (`+Inf`)."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class DurationHistogram:
    """Durations observed by the engine thread and read by scrapes on the HTTP thread.

    A plain accumulator rather than a `prometheus_client.Histogram`, so the value lives with the
    service that owns it (no global registry, no labels fixed at import) and a scrape reads it
    together with the snapshot. `observe` is O(log buckets) under a lock held for two additions.
    """

    def __init__(self, buckets: Sequence[float] = DEFRAG_DURATION_BUCKETS) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or any(not math.isfinite(b) or b <= 0 for b in bounds):
            raise ValueError(f"buckets must be positive and finite, got {buckets!r}")
        if any(lo >= hi for lo, hi in pairwise(bounds)):
            raise ValueError(f"buckets must be strictly increasing, got {buckets!r}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; last is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        """Count one duration; a negative or NaN duration is a caller's bug and is refused."""
        if not seconds >= 0.0:
            raise ValueError(f"a duration must be >= 0 seconds, got {seconds!r}")
        index = bisect_left(self.bounds, seconds)  # first bound >= seconds: Prometheus' `le`
        with self._lock:
            self._counts[index] += 1
            self._sum += seconds

    def read(self) -> HistogramReading:
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        running = 0
        cumulative = []
        for n in counts:
            running += n
            cumulative.append(running)
        return HistogramReading(self.bounds, tuple(cumulative), total)


# fmt: off
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)
INTER_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0,
)
REQUEST_BUCKETS: tuple[float, ...] = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0,
)
QUEUE_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    300.0,
)
WAKE_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)
# fmt: on


@dataclass(frozen=True)
class HistogramReadings:
    """A copy of every histogram, taken by one scrape."""

    defrag: HistogramReading
    time_to_first_token: HistogramReading
    inter_token: HistogramReading
    request: HistogramReading
    queue: HistogramReading
    page_lifetime: HistogramReading
    idle_before_evict: HistogramReading
    reuse_gap: HistogramReading
    wake: HistogramReading


@dataclass(frozen=True)
class Histograms:
    """Every duration the agent serves as a histogram, owned by its service: defragmentation
    runs, and per request (as vLLM exports them) the time to first token, the gaps between
    tokens, the whole request and the time it waited before its first admission."""

    defrag: DurationHistogram = field(default_factory=DurationHistogram)
    time_to_first_token: DurationHistogram = field(
        default_factory=lambda: DurationHistogram(TIME_TO_FIRST_TOKEN_BUCKETS)
    )
    inter_token: DurationHistogram = field(
        default_factory=lambda: DurationHistogram(INTER_TOKEN_BUCKETS)
    )
    request: DurationHistogram = field(default_factory=lambda: DurationHistogram(REQUEST_BUCKETS))
    queue: DurationHistogram = field(default_factory=lambda: DurationHistogram(QUEUE_BUCKETS))
    wake: DurationHistogram = field(default_factory=lambda: DurationHistogram(WAKE_BUCKETS))
    """Wakes of the sleeping model, until it could step again (`kvctl.agent.model_sleep`)."""
    residency: Residency = field(default_factory=Residency)
    """The prefix cache's own counts (`kvctl.agent.prefix.residency`), read at each scrape."""

    def read(self) -> HistogramReadings:
        residency = self.residency
        return HistogramReadings(
            self.defrag.read(),
            self.time_to_first_token.read(),
            self.inter_token.read(),
            self.request.read(),
            self.queue.read(),
            _counts_reading(residency.lifetime),
            _counts_reading(residency.idle_before_evict),
            _counts_reading(residency.reuse_gap),
            self.wake.read(),
        )


def _counts_reading(counts: DurationCounts) -> HistogramReading:
    cumulative, total = counts.cumulative()
    return HistogramReading(counts.bounds, cumulative, total)


# ---- the table --------------------------------------------------------------------------------


class KvEventCounters(Protocol):
    """What the KV-events publisher counts (`KVEventPublisher`), read without its lock."""

    published_batches: int
    dropped_batches: int
    dropped_events: int
    ignored_replay_requests: int


@dataclass(frozen=True)
class KvEventsReading:
    """The publisher's counters, copied once per scrape so every pool's series agree."""

    published_batches: int
    dropped_batches: int
    dropped_events: int
    ignored_replay_requests: int

    @classmethod
    def of(cls, publisher: KvEventCounters | None) -> KvEventsReading | None:
        if publisher is None:
            return None
        return cls(
            publisher.published_batches,
            publisher.dropped_batches,
            publisher.dropped_events,
            publisher.ignored_replay_requests,
        )


@dataclass(frozen=True)
class Reading:
    """What one scrape reads; every getter takes it. `alerts` are the pool's current alerts
    (agent-wide ones included); `kv_events` is None when the agent publishes no KV events."""

    snapshot: PoolSnapshot
    histograms: HistogramReadings
    alerts: tuple[Alert, ...] = ()
    kv_events: KvEventsReading | None = None


LabelledValues = Mapping[tuple[str, ...], float]
Value = float | LabelledValues | HistogramReading | None
"""A getter's answer: a number (no extra labels), a number per extra-label tuple, a histogram,
or None when the value does not exist on this host or in this window (the series is left out)."""


@dataclass(frozen=True)
class MetricDef:
    """One metric family. `labels` are the labels beyond `pool`, which every series carries;
    `presence` tells the reader of docs/metrics.md when the series exists."""

    name: str
    type: MetricType
    help: str
    value: Callable[[Reading], Value]
    labels: tuple[str, ...] = ()
    presence: str = "always"


def _field(name: str) -> Callable[[Reading], Value]:
    return attrgetter(f"snapshot.{name}")


def _defrag_runs(reading: Reading) -> LabelledValues:
    """Every trigger, even at 0, so `rate()` has a starting point before the first run."""
    runs = {trigger.value: 0 for trigger in DefragTrigger}
    runs.update(reading.snapshot.defrag_runs_total)
    return {(trigger,): n for trigger, n in runs.items()}


def _resizes(reading: Reading) -> LabelledValues:
    resizes = dict.fromkeys(RESIZE_DIRECTIONS, 0)
    resizes.update(reading.snapshot.resizes_total)
    return {(direction,): n for direction, n in resizes.items()}


def _share(value: Callable[[PoolShare], float]) -> Callable[[Reading], Value]:
    """A value of the pool's share of the budget; no series when it shares none."""

    def read(reading: Reading) -> Value:
        share = reading.snapshot.share
        return None if share is None else value(share)

    return read


def _rebalanced(name: str) -> Callable[[Reading], Value]:
    """Moves (or bytes) in and out of the pool, both directions even at 0."""

    def read(reading: Reading) -> Value:
        share = reading.snapshot.share
        if share is None:
            return None
        counts = dict.fromkeys(REBALANCE_DIRECTIONS, 0)
        counts.update(getattr(share, name))
        return {(direction,): n for direction, n in counts.items()}

    return read


def _by(name: str, keys: Sequence[str]) -> Callable[[Reading], LabelledValues]:
    """A counter by one label: every known key, even at 0, so `rate()` has a starting point."""

    def values(reading: Reading) -> LabelledValues:
        counts = dict.fromkeys(keys, 0)
        counts.update(attrgetter(name)(reading.snapshot))
        return {(key,): n for key, n in counts.items()}

    return values


def _sleep_level(reading: Reading) -> Value:
    """0 awake; the level it sleeps (or, waking, slept) at."""
    return reading.snapshot.sleep.level or 0


def _waking(reading: Reading) -> Value:
    return int(reading.snapshot.sleep.state == "waking")


def _gpu_used(reading: Reading) -> LabelledValues:
    return {(str(gpu.index),): gpu.used_bytes for gpu in reading.snapshot.gpus}


def _gpu_total(reading: Reading) -> LabelledValues:
    return {(str(gpu.index),): gpu.total_bytes for gpu in reading.snapshot.gpus}


def _tiers(reading: Reading) -> list[TierReading]:
    """The tiers this agent has: given room at some point, or holding counts. A disk-only agent
    lists an empty host tier it was never given; that tier has no series. A tier turned off
    after use keeps its series (its counters stay), so no `rate()` loses its history."""
    return [tier for tier in reading.snapshot.tiers if _configured(tier)]


def _configured(tier: TierReading) -> bool:
    return bool(
        tier.capacity_pages
        or tier.stored_pages_total
        or tier.hits_tokens_total
        or tier.evicted_pages_total
        or any(tier.store_failures_total.values())
        or any(tier.load_failures_total.values())
    )


def _prefix_hits(reading: Reading) -> LabelledValues:
    """Hit tokens by the tier their pages came from: device always, then each tier the agent
    has, so `sum without (tier)` is every hit once."""
    snapshot = reading.snapshot
    by_tier = snapshot.prefix_hits_tokens_by_tier
    counts = {"device": by_tier.get("device", snapshot.prefix_hits_tokens_total)}
    for tier in _tiers(reading):
        counts[tier.tier] = by_tier.get(tier.tier, 0)
    return {(tier,): n for tier, n in counts.items()}


def _per_tier(value: Callable[[TierReading], float | None]) -> Callable[[Reading], LabelledValues]:
    """One series per tier the agent has; a tier whose value is None has none."""

    def values(reading: Reading) -> LabelledValues:
        out: dict[tuple[str, ...], float] = {}
        for tier in _tiers(reading):
            number = value(tier)
            if number is not None:
                out[(tier.tier,)] = number
        return out

    return values


def _tier_failures(name: str, reasons: Sequence[str]) -> Callable[[Reading], LabelledValues]:
    """Failures per tier and reason: every reason, even at 0, so `rate()` has a start."""

    def values(reading: Reading) -> LabelledValues:
        out: dict[tuple[str, ...], float] = {}
        for tier in _tiers(reading):
            counts = dict.fromkeys(reasons, 0)
            counts.update(getattr(tier, name))
            out.update({(tier.tier, reason): n for reason, n in counts.items()})
        return out

    return values


def _alerts_active(reading: Reading) -> LabelledValues:
    """1 per (alertname, severity, state) held: alerts of one name told apart by a further
    label (tier, gpu, reason) are one series, so the family's labels stay fixed."""
    return {(alert.name, alert.severity, alert.state): 1 for alert in reading.alerts}


def _kv_events(name: str) -> Callable[[Reading], Value]:
    def read(reading: Reading) -> Value:
        events = reading.kv_events
        return None if events is None else getattr(events, name)

    return read


def _alerts_of(alerts: Sequence[Alert], pool: str) -> tuple[Alert, ...]:
    """The pool's alerts, and those without a pool (agent-wide: on every pool's series)."""
    return tuple(alert for alert in alerts if alert.labels.get("pool", "") in (pool, ""))


_SHARED = "when the agent serves several models (their pools share one budget)"
_IN_WINDOW = "over the last `window_seconds` (default 300 s)"
_TIER_NAMES = ", ".join(TIER_NAMES)
_PER_TIER = f"per tier the agent has ({_TIER_NAMES})"
_TRIGGERS = ", ".join(trigger.value for trigger in DefragTrigger)
_KV_EVENTS = "when the agent publishes KV events (--kv-events-endpoint)"

METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        "kvctl_build_info",
        "gauge",
        "Always 1; the `version` label is the running kvctl version.",
        lambda r: {(__version__,): 1},
        labels=("version",),
    ),
    # ---- occupancy
    MetricDef(
        "kvctl_pool_capacity_pages",
        "gauge",
        "Pages in the pool (free + used + cached).",
        _field("capacity_pages"),
    ),
    MetricDef(
        "kvctl_pool_page_size_tokens",
        "gauge",
        "Tokens one page holds (--page-size): the block size a router sizes prefix matches by, "
        "with kvctl_pool_capacity_pages as the block count (docs/gateway.md).",
        _field("page_size"),
    ),
    MetricDef(
        "kvctl_pool_used_pages",
        "gauge",
        "Pages held by at least one running sequence.",
        _field("used_pages"),
    ),
    MetricDef(
        "kvctl_pool_cached_pages",
        "gauge",
        "Pages held only by the prefix cache (evictable).",
        _field("cached_pages"),
    ),
    MetricDef(
        "kvctl_pool_free_pages",
        "gauge",
        "Pages held by nobody.",
        _field("free_pages"),
    ),
    MetricDef(
        "kvctl_pool_capacity_bytes",
        "gauge",
        "Bytes of K/V storage the pool holds.",
        _field("capacity_bytes"),
    ),
    MetricDef(
        "kvctl_pool_used_bytes",
        "gauge",
        "Bytes of the pages held by running sequences.",
        _field("used_bytes"),
    ),
    MetricDef(
        "kvctl_pool_utilization_ratio",
        "gauge",
        "(used + cached pages) / capacity pages, 0..1.",
        _field("utilization_ratio"),
    ),
    MetricDef(
        "kvctl_pool_pressure_ratio",
        "gauge",
        "used pages / capacity pages, 0..1: cached prefix pages are reclaimable on demand, so "
        "this, not utilization, says how close the pool is to refusing work.",
        _field("pressure_ratio"),
    ),
    MetricDef(
        "kvctl_pool_segments",
        "gauge",
        "Segments (separately allocated chunks of pages) the pool is made of.",
        _field("segments"),
    ),
    MetricDef(
        "kvctl_pool_max_pages",
        "gauge",
        "Upper limit on the pool's capacity in pages (--max-pool-pages).",
        _field("max_pool_pages"),
        presence="when a limit is set",
    ),
    # ---- fragmentation
    MetricDef(
        "kvctl_pool_fragmentation_ratio",
        "gauge",
        "1 - largest run of consecutive free pages / free pages; 0 when nothing is free.",
        _field("fragmentation_ratio"),
    ),
    MetricDef(
        "kvctl_pool_free_extents",
        "gauge",
        "Runs of consecutive free pages.",
        _field("free_extents"),
    ),
    MetricDef(
        "kvctl_pool_largest_free_run_pages",
        "gauge",
        "Length of the longest run of consecutive free pages.",
        _field("largest_free_run"),
    ),
    MetricDef(
        "kvctl_pool_reserved_pages",
        "gauge",
        "Free pages set aside for running sequences' next pages (part of the free pages; "
        "given back to any allocation that needs them).",
        _field("reserved_pages"),
    ),
    # ---- sliding windows
    MetricDef(
        "kvctl_pool_page_groups",
        "gauge",
        "Page tables per request: 1, or one per layer group for a model whose sliding-window "
        "layers keep pages of their own (--window-pages release).",
        _field("page_groups"),
    ),
    MetricDef(
        "kvctl_pool_window_pages",
        "gauge",
        "Pages running requests' sliding-window layer groups hold (part of the used pages).",
        _field("window_pages"),
    ),
    MetricDef(
        "kvctl_pool_window_released_pages_total",
        "counter",
        "Pages sliding windows gave back while their requests ran (free, or cached, at once).",
        _field("window_released_pages_total"),
    ),
    # ---- prefix pins
    MetricDef(
        "kvctl_prefix_pins",
        "gauge",
        "Prefixes pinned on the device (kvctl prefix pin): never evicted while pinned.",
        _field("prefix_pins"),
    ),
    MetricDef(
        "kvctl_prefix_pinned_pages",
        "gauge",
        "Pages pinned prefixes hold (part of the used pages).",
        _field("prefix_pinned_pages"),
    ),
    MetricDef(
        "kvctl_prefix_pin_cap_pages",
        "gauge",
        "The most pages pins may hold (prefix_cache.max_pinned_share of the pool).",
        _field("prefix_pin_cap_pages"),
    ),
    # ---- sleeping models
    MetricDef(
        "kvctl_model_sleep_level",
        "gauge",
        "0 while the model is awake; 1 or 2 while it sleeps (kvctl sleep, sleep.idle_s) or "
        "wakes: 1 keeps its weights in host memory, 2 dropped them.",
        _sleep_level,
    ),
    MetricDef(
        "kvctl_model_waking",
        "gauge",
        "1 while the model wakes (its weights loading, its requests waiting).",
        _waking,
    ),
    MetricDef(
        "kvctl_model_sleep_released_bytes",
        "gauge",
        "Device memory the sleeping model gave back: its KV pool, and on a GPU its weights "
        "(0 when awake).",
        _field("sleep.released_bytes"),
    ),
    MetricDef(
        "kvctl_model_sleeps_total",
        "counter",
        "Times the model fell asleep, by trigger (manual: kvctl sleep; idle: sleep.idle_s).",
        _by("sleep.sleeps_total", SLEEP_TRIGGERS),
        labels=("trigger",),
    ),
    MetricDef(
        "kvctl_model_wakes_total",
        "counter",
        "Times the model woke, by trigger (manual: kvctl wake; request: a request for it).",
        _by("sleep.wakes_total", WAKE_TRIGGERS),
        labels=("trigger",),
    ),
    MetricDef(
        "kvctl_model_wake_seconds",
        "histogram",
        "From a wake to the moment the model can step again: its pool allocated, its weights "
        "back on the device or reloaded (requests waiting for it wait this long).",
        attrgetter("histograms.wake"),
    ),
    # ---- allocation
    MetricDef(
        "kvctl_alloc_attempts_total",
        "counter",
        "Page allocations attempted.",
        _field("alloc_attempts_total"),
    ),
    MetricDef(
        "kvctl_alloc_failures_total",
        "counter",
        "Page allocations that failed even after evicting cached pages and allowed growth.",
        _field("alloc_failures_total"),
    ),
    MetricDef(
        "kvctl_alloc_success_ratio",
        "gauge",
        f"Successful / attempted page allocations {_IN_WINDOW}.",
        _field("alloc_success_ratio"),
        presence="when an allocation was attempted in the window",
    ),
    # ---- prefix cache
    MetricDef(
        "kvctl_prefix_cache_queries_tokens_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        _field("prefix_queries_tokens_total"),
    ),
    MetricDef(
        "kvctl_prefix_cache_hits_tokens_total",
        "counter",
        "Prompt tokens found in the prefix cache (their K/V was reused, not recomputed), by the "
        "tier their pages came from: device (the pool itself), host or disk (loaded from a tier "
        "below); `sum without (tier)` counts every hit once.",
        _prefix_hits,
        labels=("tier",),
        presence=f"device always; {_PER_TIER}",
    ),
    MetricDef(
        "kvctl_prefix_cache_hit_ratio",
        "gauge",
        f"Prompt tokens found / looked up in the prefix cache {_IN_WINDOW}.",
        _field("prefix_hit_ratio"),
        presence="when a prompt was looked up in the window",
    ),
    # ---- tiers below the device pool
    MetricDef(
        "kvctl_kv_tier_capacity_bytes",
        "gauge",
        "Bytes the tier may hold (on disk: page files, headers included); 0 when turned off.",
        _per_tier(attrgetter("capacity_bytes")),
        labels=("tier",),
        presence=_PER_TIER,
    ),
    MetricDef(
        "kvctl_kv_tier_used_bytes",
        "gauge",
        "Bytes of the pages the tier holds.",
        _per_tier(attrgetter("used_bytes")),
        labels=("tier",),
        presence=_PER_TIER,
    ),
    MetricDef(
        "kvctl_kv_tier_stored_pages_total",
        "counter",
        "Pages written into the tier: prefix pages the device evicted (host), or pages the "
        "tier above evicted (disk).",
        _per_tier(attrgetter("stored_pages_total")),
        labels=("tier",),
        presence=_PER_TIER,
    ),
    MetricDef(
        "kvctl_kv_tier_stored_bytes_total",
        "counter",
        "Bytes of the pages written into the tier.",
        _per_tier(attrgetter("stored_bytes_total")),
        labels=("tier",),
        presence=_PER_TIER,
    ),
    MetricDef(
        "kvctl_kv_tier_loaded_pages_total",
        "counter",
        "Pages read from the tier into the device pool for a prompt that found them there.",
        _per_tier(attrgetter("loaded_pages_total")),
        labels=("tier",),
        presence=_PER_TIER,
    ),
    MetricDef(
        "kvctl_kv_tier_loaded_bytes_total",
        "counter",
        "Bytes of the pages read from the tier into the device pool.",
        _per_tier(attrgetter("loaded_bytes_total")),
        labels=("tier",),
        presence=_PER_TIER,
    ),
    MetricDef(
        "kvctl_kv_tier_store_seconds_total",
        "counter",
        "Seconds spent storing pages into the tier (copying them out of the device or the tier "
        "above, and writing them).",
        _per_tier(attrgetter("store_seconds_total")),
        labels=("tier",),
        presence=_PER_TIER,
    ),
    MetricDef(
        "kvctl_kv_tier_load_seconds_total",
        "counter",
        "Seconds spent loading pages from the tier (reading and checking them, copying them "
        "to the device); divided by the tier's hit tokens, compare it with "
        "kvctl_prefill_seconds_per_token.",
        _per_tier(attrgetter("load_seconds_total")),
        labels=("tier",),
        presence=_PER_TIER,
    ),
    MetricDef(
        "kvctl_kv_tier_evicted_pages_total",
        "counter",
        "Pages that left the tier to make room (handed to the tier below, or dropped).",
        _per_tier(attrgetter("evicted_pages_total")),
        labels=("tier",),
        presence=_PER_TIER,
    ),
    MetricDef(
        "kvctl_kv_tier_store_failures_total",
        "counter",
        "Pages not stored into the tier, by reason: full (no room and nothing evictable) or io "
        "(a write failed: the disk is full, the directory is gone).",
        _tier_failures("store_failures_total", STORE_FAILURES),
        labels=("tier", "reason"),
        presence=_PER_TIER,
    ),
    MetricDef(
        "kvctl_kv_tier_load_failures_total",
        "counter",
        f"Pages found in the tier's index but not usable, by reason ({', '.join(LOAD_FAILURES)})"
        ": each is a miss, so the page is computed, never served wrong.",
        _tier_failures("load_failures_total", LOAD_FAILURES),
        labels=("tier", "reason"),
        presence=_PER_TIER,
    ),
    MetricDef(
        "kvctl_kv_tier_filesystem_free_bytes",
        "gauge",
        "Free bytes (for unprivileged users) of the filesystem holding the disk tier's "
        "directory; below capacity − used bytes, the tier's stores will start failing.",
        _per_tier(attrgetter("filesystem_free_bytes")),
        labels=("tier",),
        presence="disk tier, when its filesystem can be read",
    ),
    MetricDef(
        "kvctl_kv_tier_filesystem_size_bytes",
        "gauge",
        "Size of the filesystem holding the disk tier's directory.",
        _per_tier(attrgetter("filesystem_size_bytes")),
        labels=("tier",),
        presence="disk tier, when its filesystem can be read",
    ),
    MetricDef(
        "kvctl_prefill_seconds_per_token",
        "gauge",
        "What computing one prompt token costs now (a moving average over long prompt steps): "
        "a tier that loads a token slower than this does not pay for itself.",
        _field("prefill_seconds_per_token"),
        presence="once a long enough prompt step was measured",
    ),
    # ---- defragmentation and resize
    MetricDef(
        "kvctl_defrag_runs_total",
        "counter",
        f"Defragmentation runs, by trigger ({_TRIGGERS}).",
        _defrag_runs,
        labels=("trigger",),
    ),
    MetricDef(
        "kvctl_defrag_pages_moved_total",
        "counter",
        "Pages copied to a lower id by defragmentation (including shrink evacuations).",
        _field("defrag_pages_moved_total"),
    ),
    MetricDef(
        "kvctl_defrag_duration_seconds",
        "histogram",
        "Wall time of one defragmentation run, from its first batch to its last.",
        attrgetter("histograms.defrag"),
    ),
    # ---- residency of cached pages
    MetricDef(
        "kvctl_prefix_page_lifetime_seconds",
        "histogram",
        "From a page entering the prefix cache to its eviction, per page evicted.",
        attrgetter("histograms.page_lifetime"),
    ),
    MetricDef(
        "kvctl_prefix_page_idle_before_eviction_seconds",
        "histogram",
        "From a cached page's last use (a hit, or its insert) to its eviction, per page evicted: "
        "short idle times mean pages go before they could be reused.",
        attrgetter("histograms.idle_before_evict"),
    ),
    MetricDef(
        "kvctl_prefix_reuse_gap_seconds",
        "histogram",
        "From a cached prefix's last use to a hit on it, per hit.",
        attrgetter("histograms.reuse_gap"),
    ),
    MetricDef(
        "kvctl_prefix_evicted_pages_by_reason_total",
        "counter",
        f"Prefix pages evicted, by what needed the room ({', '.join(EVICTION_REASONS)}).",
        _by("prefix_evictions_by_reason_total", EVICTION_REASONS),
        labels=("reason",),
    ),
    MetricDef(
        "kvctl_preemptions_by_reason_total",
        "counter",
        f"Preempted requests, by reason ({', '.join(PREEMPTION_REASONS)}).",
        _by("preemptions_by_reason_total", PREEMPTION_REASONS),
        labels=("reason",),
    ),
    MetricDef(
        "kvctl_pool_token_slots_used",
        "gauge",
        "Token slots of the used pages that hold a token's K/V (page slots times page size, less "
        "partly filled last pages and pages taken ahead).",
        _field("token_slots_used"),
    ),
    MetricDef(
        "kvctl_pool_token_usage_ratio",
        "gauge",
        "Token slots holding K/V / the pool's token slots: usage in tokens, beside the page "
        "usage of kvctl_pool_pressure_ratio.",
        _field("token_usage_ratio"),
    ),
    MetricDef(
        "kvctl_pool_resizes_total",
        "counter",
        "Pool resizes, by direction (grow, shrink).",
        _resizes,
        labels=("direction",),
    ),
    # ---- one budget, several pools
    MetricDef(
        "kvctl_pool_rebalances_total",
        "counter",
        "Moves of memory between the pools of one budget that changed this pool: `in` it took "
        "memory, `out` it gave memory.",
        _rebalanced("rebalances_total"),
        labels=("direction",),
        presence=_SHARED,
    ),
    MetricDef(
        "kvctl_pool_rebalanced_bytes_total",
        "counter",
        "Bytes this pool took (`in`) or gave (`out`) in moves between the pools of one budget.",
        _rebalanced("rebalanced_bytes_total"),
        labels=("direction",),
        presence=_SHARED,
    ),
    MetricDef(
        "kvctl_kv_budget_bytes",
        "gauge",
        "The KV budget all the agent's pools share (the same on each pool's series).",
        _share(lambda share: share.budget_bytes),
        presence=_SHARED,
    ),
    MetricDef(
        "kvctl_kv_budget_assigned_bytes",
        "gauge",
        "Bytes all the agent's pools hold together (the same on each pool's series); never "
        "above kvctl_kv_budget_bytes.",
        _share(lambda share: share.assigned_bytes),
        presence=_SHARED,
    ),
    MetricDef(
        "kvctl_pool_floor_pages",
        "gauge",
        "The smallest the pool may become in its budget.",
        _share(lambda share: share.floor_pages),
        presence=_SHARED,
    ),
    MetricDef(
        "kvctl_pool_ceiling_pages",
        "gauge",
        "The largest the pool may become in its budget.",
        _share(lambda share: share.ceiling_pages),
        presence=_SHARED,
    ),
    MetricDef(
        "kvctl_pool_pinned",
        "gauge",
        "1 while an operator's resize pins the pool's size (the agent moves no memory in or "
        "out of it), else 0.",
        _share(lambda share: float(share.pinned)),
        presence=_SHARED,
    ),
    MetricDef(
        "kvctl_pool_under_pressure",
        "gauge",
        "1 while requests wait for pages or allocations failed or requests were preempted "
        "since the last check (every 0.5 s), else 0.",
        _share(lambda share: float(share.under_pressure)),
        presence=_SHARED,
    ),
    MetricDef(
        "kvctl_pool_reclaimable_pages",
        "gauge",
        "Pages the pool could give another pool of its budget now (whole segments beyond "
        "what it uses, has promised and keeps as headroom).",
        _share(lambda share: share.reclaimable_pages),
        presence=_SHARED,
    ),
    # ---- serving (the latencies and token counts vLLM exports)
    MetricDef(
        "kvctl_time_to_first_token_seconds",
        "histogram",
        "From a request's arrival at the agent to its first generated token.",
        attrgetter("histograms.time_to_first_token"),
    ),
    MetricDef(
        "kvctl_inter_token_latency_seconds",
        "histogram",
        "Between two consecutive tokens of one request, as the engine hands them out.",
        attrgetter("histograms.inter_token"),
    ),
    MetricDef(
        "kvctl_request_latency_seconds",
        "histogram",
        "From a request's arrival to its end, whatever the finish reason.",
        attrgetter("histograms.request"),
    ),
    MetricDef(
        "kvctl_request_queue_time_seconds",
        "histogram",
        "From a request's arrival to its first admission (counted when the request ends; a "
        "request that never ran is not counted).",
        attrgetter("histograms.queue"),
    ),
    MetricDef(
        "kvctl_prompt_tokens_total",
        "counter",
        "Prompt tokens of the requests the agent accepted.",
        _field("prompt_tokens_total"),
    ),
    MetricDef(
        "kvctl_generation_tokens_total",
        "counter",
        "Tokens generated.",
        _field("generation_tokens_total"),
    ),
    MetricDef(
        "kvctl_prefix_cache_evicted_pages_total",
        "counter",
        "Pages the prefix cache evicted to make room.",
        _field("prefix_evictions_total"),
    ),
    # ---- scheduler
    MetricDef(
        "kvctl_requests_running",
        "gauge",
        "Requests in the running batch.",
        _field("requests_running"),
    ),
    MetricDef(
        "kvctl_requests_waiting",
        "gauge",
        "Requests queued for admission (including preempted ones).",
        _field("requests_waiting"),
    ),
    MetricDef(
        "kvctl_preemptions_total",
        "counter",
        "Requests preempted (pages released, recomputed later) because pages ran out.",
        _field("preemptions_total"),
    ),
    MetricDef(
        "kvctl_requests_max_waiting",
        "gauge",
        "The waiting queue's capacity (--max-waiting); a full queue answers 429.",
        _field("max_waiting"),
    ),
    MetricDef(
        "kvctl_oldest_waiting_seconds",
        "gauge",
        "Age of the oldest waiting request; 0 when none waits.",
        _field("oldest_waiting_seconds"),
    ),
    MetricDef(
        "kvctl_queue_stalled_seconds",
        "gauge",
        "How long requests have waited with no token produced and none admitted or refused; "
        "0 when none waits or the queue moved.",
        _field("queue_stalled_seconds"),
    ),
    MetricDef(
        "kvctl_requests_finished_total",
        "counter",
        f"Requests finished, by reason ({', '.join(FINISH_REASONS)}).",
        _by("requests_finished_total", FINISH_REASONS),
        labels=("reason",),
    ),
    MetricDef(
        "kvctl_requests_rejected_total",
        "counter",
        f"Requests refused before they were queued, by reason ({', '.join(REJECT_REASONS)}).",
        _by("requests_rejected_total", REJECT_REASONS),
        labels=("reason",),
    ),
    MetricDef(
        "kvctl_admin_actions_total",
        "counter",
        f"Audited mutations, by action ({', '.join(ADMIN_ACTIONS)}).",
        _by("admin_actions_total", ADMIN_ACTIONS),
        labels=("action",),
    ),
    # ---- alert delivery
    MetricDef(
        "kvctl_alertmanager_notifications_dropped_total",
        "counter",
        "Alert updates given up on: Alertmanager unreachable for longer than the queue's span, "
        "the queue full, or the update rejected.",
        _field("alert_notifications_dropped_total"),
    ),
    MetricDef(
        "kvctl_alerts_active",
        "gauge",
        "1 per alert the agent holds now (GET /v1/alerts), by `alertname`, `severity` and "
        "`state`; gone once it resolves. The agent evaluates its own alerts, so Prometheus' "
        'ALERTS lacks them: `kvctl status --prometheus` reads `state="firing"` here. One '
        "series per name and pool (an alert without a pool is on each pool's).",
        _alerts_active,
        labels=("alertname", "severity", "state"),
        presence="while the alert is pending or firing",
    ),
    # ---- KV events (--kv-events-endpoint)
    MetricDef(
        "kvctl_kv_events_published_batches_total",
        "counter",
        "Batches of KV events (one per engine step with events) handed to the publisher's "
        "socket; the same on each pool's series (one publisher serves every pool).",
        _kv_events("published_batches"),
        presence=_KV_EVENTS,
    ),
    MetricDef(
        "kvctl_kv_events_dropped_batches_total",
        "counter",
        "Batches of KV events dropped because the publisher's queue was full: each leaves a "
        "gap in the sequence numbers that replay cannot fill, so a router's view of the "
        "prefix cache goes stale; the same on each pool's series.",
        _kv_events("dropped_batches"),
        presence=_KV_EVENTS,
    ),
    MetricDef(
        "kvctl_kv_events_dropped_total",
        "counter",
        "KV events (pages stored or removed) in the dropped batches; the same on each pool's "
        "series.",
        _kv_events("dropped_events"),
        presence=_KV_EVENTS,
    ),
    MetricDef(
        "kvctl_kv_events_replay_ignored_total",
        "counter",
        "Requests to the replay socket left unanswered: malformed ones, and a peer's repeats "
        "before its answer; a rising count is a client that speaks the protocol wrong, or a "
        "flood. The same on each pool's series.",
        _kv_events("ignored_replay_requests"),
        presence=_KV_EVENTS,
    ),
    # ---- GPUs
    MetricDef(
        "kvctl_gpu_memory_used_bytes",
        "gauge",
        "Device memory in use on the GPU, as NVML reports it (all processes).",
        _gpu_used,
        labels=("gpu",),
        presence="when NVML sees GPUs",
    ),
    MetricDef(
        "kvctl_gpu_memory_total_bytes",
        "gauge",
        "Device memory of the GPU, as NVML reports it.",
        _gpu_total,
        labels=("gpu",),
        presence="when NVML sees GPUs",
    ),
)


# ---- families ---------------------------------------------------------------------------------

Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily
_FAMILY_TYPES: dict[MetricType, type[Family]] = {
    "gauge": GaugeMetricFamily,
    "counter": CounterMetricFamily,
    "histogram": HistogramMetricFamily,
}


def _empty_family(metric: MetricDef) -> Family:
    return _FAMILY_TYPES[metric.type](metric.name, metric.help, labels=("pool", *metric.labels))


def _add_sample(
    family: Family, labels: list[str], value: float | HistogramReading, name: str
) -> None:
    """One series of `family`: a histogram's buckets and sum, or a gauge's or counter's value."""
    if isinstance(family, HistogramMetricFamily):
        if not isinstance(value, HistogramReading):
            raise TypeError(f"{name}: a histogram family cannot take {value!r}")
        buckets = [
            (floatToGoString(bound), n)
            for bound, n in zip((*value.bounds, math.inf), value.cumulative, strict=True)
        ]
        family.add_metric(labels, buckets, value.sum)
    elif isinstance(value, HistogramReading):
        raise TypeError(f"{name}: a {family.type} family cannot take a histogram")
    else:
        family.add_metric(labels, value)


def _family(metric: MetricDef, readings: Sequence[Reading]) -> Family | None:
    """The family of `metric` over every pool's reading, or None when it has no series."""
    family = _empty_family(metric)
    for reading in readings:
        value = metric.value(reading)
        if value is None:
            continue
        pool = reading.snapshot.pool
        if isinstance(value, Mapping):
            for extra, number in value.items():
                _add_sample(family, [pool, *extra], number, metric.name)
        else:
            _add_sample(family, [pool], value, metric.name)
    return family if family.samples else None


def _with_pools(family: Metric, pools: Sequence[str]) -> Metric:
    """A copy of a prometheus-client family whose samples are repeated with each `pool`."""
    labelled = Metric(family.name, family.documentation, family.type, family.unit)
    labelled.samples = [
        s._replace(labels={"pool": pool, **s.labels}) for pool in pools for s in family.samples
    ]
    return labelled


PoolReadings = Callable[[], Sequence[tuple[PoolSnapshot, Histograms]]]
"""Every pool's latest snapshot and histograms (one pair per served model)."""
AlertsFn = Callable[[], Sequence[Alert]]
"""The alert loop's latest evaluation (replaced whole by each one, so read without a lock)."""
KvEventsFn = Callable[[], KvEventCounters | None]
"""The KV-events publisher, or None when the agent publishes none."""


def _no_alerts() -> Sequence[Alert]:
    return ()


def _no_kv_events() -> KvEventCounters | None:
    return None


class PoolCollector(Collector):
    """Builds every family of `METRICS` from each pool's snapshot, once per scrape.

    `runtime` collectors (prometheus-client's process and platform collectors) are read in
    the same scrape and their series are given each pool's `pool` label, so every series the
    agent serves can be joined on `pool`.
    """

    def __init__(
        self,
        readings_fn: PoolReadings,
        runtime: Iterable[Collector] = (),
        alerts_fn: AlertsFn = _no_alerts,
        kv_events_fn: KvEventsFn = _no_kv_events,
    ) -> None:
        self._readings_fn = readings_fn
        self._runtime = tuple(runtime)
        self._alerts_fn = alerts_fn
        self._kv_events_fn = kv_events_fn

    def describe(self) -> Iterator[Metric]:
        """The families' names, without reading a snapshot (the registry checks clashes)."""
        for metric in METRICS:
            yield _empty_family(metric)
        for collector in self._runtime:
            yield from collector.collect()

    def collect(self) -> Iterator[Metric]:
        alerts = self._alerts_fn()
        kv_events = KvEventsReading.of(self._kv_events_fn())
        readings = [
            Reading(snapshot, h.read(), _alerts_of(alerts, snapshot.pool), kv_events)
            for snapshot, h in self._readings_fn()
        ]
        for metric in METRICS:
            family = _family(metric, readings)
            if family is not None:
                yield family
        for collector in self._runtime:
            for runtime_family in collector.collect():
                yield _with_pools(runtime_family, [reading.snapshot.pool for reading in readings])


def build_registry(
    snapshot_fn: Callable[[], PoolSnapshot],
    histograms: Histograms,
    alerts_fn: AlertsFn = _no_alerts,
    kv_events_fn: KvEventsFn = _no_kv_events,
) -> CollectorRegistry:
    """A fresh registry of one pool (never the process-global one, so two agents in one test
    process and repeated builds do not clash) serving the kvctl families and the process
    metrics."""
    return pools_registry(lambda: [(snapshot_fn(), histograms)], alerts_fn, kv_events_fn)


def pools_registry(
    readings_fn: PoolReadings,
    alerts_fn: AlertsFn = _no_alerts,
    kv_events_fn: KvEventsFn = _no_kv_events,
) -> CollectorRegistry:
    """A fresh registry serving every pool of an agent (`build_registry` for one)."""
    registry = CollectorRegistry()
    runtime = (
        ProcessCollector(registry=None),
        PlatformCollector(registry=None),
    )
    registry.register(PoolCollector(readings_fn, runtime, alerts_fn, kv_events_fn))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The `/metrics` body and its content type.

    The text format version 0.0.4, which every Prometheus-compatible scraper reads; all names
    here are legacy-valid, so the newer format would add nothing.
    """
    return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4
