"""Every kvctl alert, in one table, each with one owner.

The agent owns every alert about its own pool (`DEFINITIONS`): it evaluates them against its
snapshots, explains the likely cause from its state and the settings in force, and pushes them to
Alertmanager with the labels Prometheus would attach (`job`, `instance`). The rule file
(`kvctl alerts rules`) owns only what an agent cannot say about itself (`RULE_ONLY`): that it is
down, that no agent is scraped at all, and what needs several agents at once. So every condition
reaches Alertmanager once. Thresholds come from `AlertSettings`, so the agent and the rule file
read the same numbers.
"""

from __future__ import annotations

from kvctl.alerts import causes, text
from kvctl.alerts.definition import (
    AlertDefinition,
    Escalation,
    Fact,
    MinimumCount,
    Observation,
    Reading,
    RuleOnlyAlert,
    Threshold,
)
from kvctl.api import AlertSettings, PoolSnapshot

MIN_FREE_PAGES = 16
"""Fragmentation of fewer free pages than this says nothing (the default `min_free_pages`)."""
DEFRAG_RECENT_S = 600.0
"""A defrag within this many seconds counts as "ran recently"."""
AGENT_JOB = "kvctl-agent"
"""The Prometheus job that scrapes agents (agent/prometheus-scrape.yml, the PodMonitor), and the
`job` label of the alerts agents push (`kvctl-agent --prometheus-job`)."""
RUNBOOK_PATH = "/runbook"
"""Where an agent serves this runbook; its alerts link to `<advertise-url>/runbook#<alert>`."""
RULES_RUNBOOK_BASE = "https://kvctl-runbook.invalid/alerts"
"""The rule file's runbook base until the operator names theirs (`kvctl alerts rules
--runbook-url`): its alerts are about agents that are down or missing, so they cannot link to
an agent's own /runbook. `.invalid` never resolves, so a link nobody configured is obvious."""
FLEET_PRESSURE_SHARE = 0.5
"""KvctlFleetPressureHigh: the share of a model's agents whose pools are under pressure."""
FLEET_MIN_AGENTS = 2
"""KvctlFleetPressureHigh: a fleet is at least this many agents serving the model."""
ALLOC_CRITICAL_HOLD = 0.8
"""An escalated allocation alert stays critical down to this share of its trigger."""

FORMATS = {
    # name: (agent-side formatter, Prometheus template function)
    "percent": (text.percent, "humanizePercentage"),
    "ratio": (text.ratio, 'printf "%.2f"'),
    "count": (text.count, 'printf "%.0f"'),
    "rate": (text.rate, 'printf "%.1f"'),
    "seconds": (text.span, "humanizeDuration"),
    "size": (text.size, "humanize1024"),
}


def runbook_url(base: str, anchor: str) -> str:
    """The absolute link to one alert's runbook section."""
    return f"{base.rstrip('/')}#{anchor}"


FACTS: dict[str, Fact] = {
    "free_pages": Fact(lambda s: s.free_pages, "count"),
    "free_extents": Fact(lambda s: s.free_extents, "count"),
    "capacity_pages": Fact(lambda s: s.capacity_pages, "count"),
    "used_pages": Fact(lambda s: s.used_pages, "count"),
    "cached_pages": Fact(lambda s: s.cached_pages, "count"),
    "requests_waiting": Fact(lambda s: s.requests_waiting, "count"),
    "requests_running": Fact(lambda s: s.requests_running, "count"),
    "utilization": Fact(lambda s: s.utilization_ratio, "percent"),
    "pressure": Fact(lambda s: s.pressure_ratio, "percent"),
    "window_alloc_attempts": Fact(lambda s: s.window_alloc_attempts, "count"),
    "window_alloc_failures": Fact(lambda s: s.window_alloc_failures, "count"),
    "window": Fact(lambda s: s.window_seconds, "seconds"),
    "segment_bytes": Fact(lambda s: s.segment_pages * s.bytes_per_page, "size"),
    "budget": Fact(lambda s: s.share.budget_bytes if s.share else 0, "size"),
    "budget_unassigned": Fact(lambda s: s.share.unassigned_bytes if s.share else 0, "size"),
    "budget_pools": Fact(lambda s: s.share.pools_total if s.share else 0, "count"),
    "prefix_pins": Fact(lambda s: s.prefix_pins, "count"),
    "pinned_pages": Fact(lambda s: s.prefix_pinned_pages, "count"),
}


# ---- what each alert measures ---------------------------------------------------------------


def _alloc_success(o: Observation) -> list[Reading]:
    s = o.snapshot
    if s.window_alloc_attempts <= 0:
        return []
    success = 1.0 - s.window_alloc_failures / s.window_alloc_attempts
    return [Reading(success, count=s.window_alloc_failures)]


def _failure_share(s: PoolSnapshot) -> float:
    return s.window_alloc_failures / s.window_alloc_attempts if s.window_alloc_attempts else 0.0


def _alloc_critical(s: PoolSnapshot, settings: AlertSettings) -> bool:
    return (
        s.window_alloc_attempts >= settings.alloc_attempts_min
        and _failure_share(s) >= settings.alloc_failure_critical
    )


def _alloc_still_critical(s: PoolSnapshot, settings: AlertSettings) -> bool:
    return _failure_share(s) >= ALLOC_CRITICAL_HOLD * settings.alloc_failure_critical


def _fragmentation(o: Observation) -> list[Reading]:
    s = o.snapshot
    return [Reading(s.fragmentation_ratio)] if s.free_pages >= MIN_FREE_PAGES else []


def _fragmentation_after_defrag(o: Observation) -> list[Reading]:
    age = o.snapshot.last_defrag_age_seconds
    recent = age is not None and age <= DEFRAG_RECENT_S
    return _fragmentation(o) if recent else []


def _pressure(o: Observation) -> list[Reading]:
    return [Reading(o.snapshot.pressure_ratio)]


def _utilization(o: Observation) -> list[Reading]:
    """A reading only while the pool serves traffic: requests were given pages within the stats
    window. An idle pool (just started, or drained) says nothing about the size its traffic
    needs, so the `for` period counts only time spent serving. None while requests wait either:
    a pool with a queue is not too big, whatever holds it (a shrink would make the wait worse),
    nor while the model sleeps (it holds nothing: empty, not too big)."""
    s = o.snapshot
    if s.window_alloc_attempts <= 0 or s.requests_waiting or s.sleep.state != "awake":
        return []
    return [Reading(s.utilization_ratio)]


def _prefix_hit(o: Observation) -> list[Reading]:
    s = o.snapshot
    if not s.prefix_cache_enabled or s.prefix_hit_ratio is None:
        return []
    return [Reading(s.prefix_hit_ratio)]


def _pinned(o: Observation) -> list[Reading]:
    """The share of the pool pins hold, only while requests wait: pins crowd a pool when
    others need its room, not when it has room to spare."""
    s = o.snapshot
    if not s.prefix_pins or not s.requests_waiting or not s.capacity_pages:
        return []
    return [Reading(s.prefix_pinned_pages / s.capacity_pages)]


def _preemptions(o: Observation) -> list[Reading]:
    rate = o.preemptions_per_minute
    return [] if rate is None else [Reading(rate)]


def _gpu_memory(o: Observation) -> list[Reading]:
    return [
        Reading(g.used_bytes / g.total_bytes, (("gpu", str(g.index)),))
        for g in o.snapshot.gpus
        if g.total_bytes > 0
    ]


def _queue_stalled(o: Observation) -> list[Reading]:
    return [Reading(o.snapshot.queue_stalled_seconds)]


def _queue_wait(o: Observation) -> list[Reading]:
    return [Reading(o.snapshot.oldest_waiting_seconds)]


def _tier_label(tier: str) -> tuple[tuple[str, str], ...]:
    return (("tier", tier),)


def _tier_reuse(o: Observation) -> list[Reading]:
    """Pages loaded back per page stored over the window, per tier that stored any; `count`
    is the pages stored, so a few stores after a start never alert."""
    return [
        Reading(w.loaded_pages / w.stored_pages, _tier_label(w.tier), count=w.stored_pages)
        for w in o.tiers.values()
        if w.stored_pages > 0
    ]


def _tier_load_cost(o: Observation) -> list[Reading]:
    """A tier's load seconds per loaded token over the window, as a multiple of what computing
    a prompt token costs; none until the agent has measured that."""
    prefill = o.snapshot.prefill_seconds_per_token
    if not prefill or prefill <= 0:
        return []
    return [
        Reading(w.load_seconds / w.hits_tokens / prefill, _tier_label(w.tier), count=w.loaded_pages)
        for w in o.tiers.values()
        if w.hits_tokens > 0 and w.loaded_pages > 0
    ]


def _tier_store_failures(o: Observation) -> list[Reading]:
    """Pages a tier failed to store over the window, one reading per tier and reason."""
    return [
        Reading(n, (("tier", w.tier), ("reason", reason)), count=n)
        for w in o.tiers.values()
        for reason, n in sorted(w.store_failures.items())
    ]


def _budget_room(o: Observation) -> list[Reading]:
    """The budget's unassigned bytes in this pool's segments, while the pool is under pressure
    and no pool of the budget can give memory: then only room lets it grow. None for a pool
    that shares no budget (one model)."""
    s, share = o.snapshot, o.snapshot.share
    if share is None or not share.under_pressure or share.donors > 0:
        return []
    return [Reading(max(0, share.unassigned_bytes) / (s.segment_pages * s.bytes_per_page))]


def _disk_tier_headroom(o: Observation) -> list[Reading]:
    """Free bytes of the disk tier's filesystem over the bytes the tier may still fill; none
    while the tier is full or off (it expects nothing more) or the filesystem is unreadable."""
    readings = []
    for tier in o.snapshot.tiers:
        expected = tier.capacity_bytes - tier.used_bytes
        if tier.tier == "disk" and tier.filesystem_free_bytes is not None and expected > 0:
            readings.append(Reading(tier.filesystem_free_bytes / expected, _tier_label("disk")))
    return readings


# ---- the agent's alerts ---------------------------------------------------------------------

DEFINITIONS: tuple[AlertDefinition, ...] = (
    AlertDefinition(
        name="KvctlAllocationFailures",
        severity="warning",
        summary="KV page allocations fail on pool {pool} at {instance}",
        threshold=Threshold("alloc_success_min", above=False, margin=0.005),
        measure=_alloc_success,
        value_format="percent",
        headline=(
            "{value} of the {window_alloc_attempts} page allocations of the last {window} "
            "succeeded ({window_alloc_failures} failed)"
        ),
        causes=causes.ALLOCATION_FAILURES,
        minimum=MinimumCount("alloc_failures_min"),
        escalation=Escalation("critical", _alloc_critical, _alloc_still_critical),
    ),
    AlertDefinition(
        name="KvctlQueueStalled",
        severity="critical",
        summary="Requests on pool {pool} at {instance} wait and nothing moves",
        threshold=Threshold(
            "queue_stalled_max_s", above=True, margin=0.5, relative=True, bounded=False
        ),
        measure=_queue_stalled,
        value_format="seconds",
        headline=(
            "{requests_waiting} requests have waited {value} with no token produced and none "
            "admitted or refused ({requests_running} running)"
        ),
        causes=causes.QUEUE_STALLED,
        for_scale=0.0,  # the value is already a duration
    ),
    AlertDefinition(
        name="KvctlQueueWaitLong",
        severity="warning",
        summary="Requests on pool {pool} at {instance} wait long before they start",
        threshold=Threshold(
            "queue_wait_max_s", above=True, margin=0.5, relative=True, bounded=False
        ),
        measure=_queue_wait,
        value_format="seconds",
        headline=(
            "the oldest of {requests_waiting} waiting requests has waited {value} "
            "({requests_running} running)"
        ),
        causes=causes.QUEUE_WAIT_LONG,
        for_scale=0.0,  # the value is already a duration
    ),
    AlertDefinition(
        name="KvctlFragmentationHigh",
        severity="warning",
        summary="KV pool {pool} at {instance} is fragmented",
        threshold=Threshold("fragmentation_max", above=True, margin=0.1),
        measure=_fragmentation,
        value_format="ratio",
        headline="fragmentation {value} with {free_pages} free pages in {free_extents} extents",
        causes=causes.FRAGMENTATION_HIGH,
    ),
    AlertDefinition(
        name="KvctlDefragIneffective",
        severity="warning",
        summary="Defragmentation does not bring down fragmentation of pool {pool} at {instance}",
        threshold=Threshold("fragmentation_max", above=True, margin=0.1),
        measure=_fragmentation_after_defrag,
        value_format="ratio",
        headline=(
            "fragmentation still {value} ({free_pages} free pages in {free_extents} extents) "
            "although defrag ran in the last 10 min"
        ),
        causes=causes.DEFRAG_INEFFECTIVE,
    ),
    AlertDefinition(
        name="KvctlPoolNearlyFull",
        severity="warning",
        summary="KV pool {pool} at {instance} is nearly full",
        threshold=Threshold("pressure_high", above=True, margin=0.05),
        measure=_pressure,
        value_format="percent",
        headline=(
            "running requests hold {value} of the pool: {used_pages} of {capacity_pages} "
            "pages ({cached_pages} more are cached and reclaimable)"
        ),
        causes=causes.POOL_NEARLY_FULL,
    ),
    AlertDefinition(
        name="KvctlPoolOverProvisioned",
        severity="info",
        summary="KV pool {pool} at {instance} is mostly unused",
        threshold=Threshold("utilization_low", above=False, margin=0.05),
        measure=_utilization,
        value_format="percent",
        headline="only {value} of the pool's {capacity_pages} pages hold K/V, cached included",
        causes=causes.POOL_OVER_PROVISIONED,
        for_scale=30.0,  # of serving traffic: an idle pool gives no reading (`_utilization`)
    ),
    AlertDefinition(
        name="KvctlKvBudgetExhausted",
        severity="warning",
        summary="The KV budget at {instance} has no memory left for pool {pool}",
        threshold=Threshold("budget_room_segments_min", above=False, margin=0.0, bounded=False),
        measure=_budget_room,
        value_format="ratio",
        headline=(
            "the KV budget of {budget} has {budget_unassigned} unassigned ({value} of this "
            "pool's {segment_bytes} segments) and none of its {budget_pools} pools can give "
            "memory"
        ),
        causes=causes.BUDGET_EXHAUSTED,
        for_scale=5.0,  # only a restart adds memory: a burst the next minutes absorb is no page
    ),
    AlertDefinition(
        name="KvctlPrefixHitRateLow",
        severity="info",
        summary="Prefix cache of pool {pool} at {instance} rarely hits",
        threshold=Threshold("prefix_hit_min", above=False, margin=0.05),
        measure=_prefix_hit,
        value_format="percent",
        headline="the prefix cache found {value} of the prompt tokens looked up recently",
        causes=causes.PREFIX_HIT_RATE_LOW,
        for_scale=10.0,
    ),
    AlertDefinition(
        name="KvctlPrefixPinsCrowdPool",
        severity="warning",
        summary="Pinned prefixes crowd pool {pool} at {instance}",
        threshold=Threshold("pinned_share_max", above=True, margin=0.05),
        measure=_pinned,
        value_format="percent",
        headline=(
            "{prefix_pins} pinned prefixes hold {value} of the pool ({pinned_pages} pages) while "
            "{requests_waiting} requests wait for room"
        ),
        causes=causes.PINS_CROWD_POOL,
    ),
    AlertDefinition(
        name="KvctlPreemptionStorm",
        severity="warning",
        summary="Requests on pool {pool} at {instance} are preempted over and over",
        threshold=Threshold(
            "preemptions_per_minute_max", above=True, margin=0.2, relative=True, bounded=False
        ),
        measure=_preemptions,
        value_format="rate",
        headline=(
            "{value} preemptions per minute with running requests holding {pressure} of the "
            "pool and {requests_waiting} requests waiting"
        ),
        causes=causes.PREEMPTION_STORM,
    ),
    AlertDefinition(
        name="KvctlGpuMemoryNearCapacity",
        severity="warning",
        summary="GPU memory at {instance} (pool {pool}) is nearly full",
        threshold=Threshold("gpu_memory_max", above=True, margin=0.05),
        measure=_gpu_memory,
        value_format="percent",
        headline="GPU {gpu} memory {value} used",
        causes=causes.GPU_MEMORY_NEAR_CAPACITY,
        labels=("gpu",),
    ),
    AlertDefinition(
        name="KvctlTierStoresUnused",
        severity="warning",
        summary="The {tier} tier of pool {pool} at {instance} stores pages nobody loads",
        threshold=Threshold("tier_reuse_min", above=False, margin=0.05),
        measure=_tier_reuse,
        value_format="percent",
        headline=(
            "the {tier} tier loaded back {value} as many pages as it stored over the last {window}"
        ),
        causes=causes.TIER_STORES_UNUSED,
        labels=("tier",),
        minimum=MinimumCount("tier_stores_min"),
        for_scale=10.0,
    ),
    AlertDefinition(
        name="KvctlTierLoadsSlowerThanPrefill",
        severity="warning",
        summary=(
            "Loading from the {tier} tier of pool {pool} at {instance} is slower than computing"
        ),
        threshold=Threshold(
            "tier_load_cost_max", above=True, margin=0.2, relative=True, bounded=False
        ),
        measure=_tier_load_cost,
        value_format="ratio",
        headline=(
            "loading a prompt token from the {tier} tier took {value} times as long as "
            "computing it over the last {window}"
        ),
        causes=causes.TIER_LOADS_SLOWER_THAN_PREFILL,
        labels=("tier",),
        minimum=MinimumCount("tier_loads_min"),
        for_scale=5.0,
    ),
    AlertDefinition(
        name="KvctlTierStoreFailures",
        severity="warning",
        summary="Pages fail to be stored into the {tier} tier of pool {pool} at {instance}",
        threshold=Threshold(
            "tier_store_failures_max", above=True, margin=0.5, relative=True, bounded=False
        ),
        measure=_tier_store_failures,
        value_format="count",
        headline=(
            "{value} pages failed to be stored into the {tier} tier ({reason}) over the last "
            "{window}"
        ),
        causes=causes.TIER_STORE_FAILURES,
        labels=("tier", "reason"),
    ),
    AlertDefinition(
        name="KvctlDiskTierFilesystemFull",
        severity="warning",
        summary="The disk tier of pool {pool} at {instance} will not fit on its filesystem",
        threshold=Threshold("disk_tier_free_min", above=False, margin=0.05, bounded=False),
        measure=_disk_tier_headroom,
        value_format="percent",
        headline=(
            "the disk tier's filesystem has {value} of the space the tier may still fill free"
        ),
        causes=causes.DISK_TIER_FILESYSTEM_FULL,
        labels=("tier",),
    ),
)

# ---- the rule file's alerts -----------------------------------------------------------------

_PRESSURED = 'kvctl_pool_pressure_ratio{{job="{job}"}} > {pressure_high}'
_POOLS = 'kvctl_pool_pressure_ratio{{job="{job}"}}'

AGENT_DOWN = RuleOnlyAlert(
    name="KvctlAgentDown",
    severity="critical",
    expr='up{{job="{job}"}} == 0',
    summary="kvctl agent {instance} is down",
    description=(
        "Prometheus cannot scrape the kvctl agent at {instance} (job {job}): it is stopped, "
        "crashed or unreachable, so its pool's metrics and its own alerts are missing"
    ),
    remediation=(
        "Check the process: `systemctl status kvctl-agent` and `journalctl -u kvctl-agent -n 50`"
        " (Kubernetes: `kubectl -n kvctl logs ds/kvctl-agent`); once it runs, "
        f"{text.command('{agent}', 'status')} answers"
    ),
)

AGENT_ABSENT = RuleOnlyAlert(
    name="KvctlAgentAbsent",
    severity="warning",
    expr='absent(up{{job="{job}"}})',
    summary="Prometheus scrapes no kvctl agent of job {job}",
    description=(
        "no target of job {job} exists: service discovery finds no agent (the DaemonSet, the "
        "PodMonitor or the scrape config changed), so no agent is watched for being down"
    ),
    remediation=(
        "Check the targets of job {job} on Prometheus' /targets page, "
        "`kubectl -n kvctl get ds,podmonitor kvctl-agent` and the `job_name` of the scrape "
        "config (agent/prometheus-scrape.yml); the agents' own alerts still reach Alertmanager"
    ),
    for_scale=5.0,
)

FLEET_PRESSURE = RuleOnlyAlert(
    name="KvctlFleetPressureHigh",
    severity="warning",
    expr=(
        f"(\n  count by (job, pool) ({_PRESSURED})\n  / count by (job, pool) ({_POOLS})\n)"
        f" >= {FLEET_PRESSURE_SHARE}\nand on (job, pool)\n"
        f"count by (job, pool) ({_POOLS}) >= {FLEET_MIN_AGENTS}"
    ),
    summary="Most agents serving {pool} are short of KV memory",
    description=(
        "running requests hold more than {pressure_high} of the pool on {value} of "
        "the agents of job {job} serving {pool}: the model's fleet, not one node, is short of "
        "KV memory"
    ),
    remediation=(
        "Add nodes serving {pool}, or grow the pools within their `--max-pool-pages`; each "
        "node's own KvctlPoolNearlyFull alert names it and the command for it (`kvctl --agent "
        "URL alerts list`)"
    ),
    for_scale=5.0,
    value_format="percent",
)

RULE_ONLY: tuple[RuleOnlyAlert, ...] = (AGENT_DOWN, AGENT_ABSENT, FLEET_PRESSURE)

ALL_ALERT_NAMES: tuple[str, ...] = (
    *(d.name for d in DEFINITIONS),
    *(r.name for r in RULE_ONLY),
)
