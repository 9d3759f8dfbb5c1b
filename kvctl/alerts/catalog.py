"""Every kvctl alert, in one table: what is measured, when it fires, what it says and suggests.

The agent evaluates `DEFINITIONS` against its own snapshots; `kvctl alerts rules` renders the
same records, plus `AGENT_DOWN`, into a Prometheus rule file. Thresholds come from
`AlertSettings`, so a changed default moves both sides at once.
"""

from __future__ import annotations

from kvctl.alerts import causes, text
from kvctl.alerts.definition import (
    AlertDefinition,
    Fact,
    Observation,
    Reading,
    RuleOnlyAlert,
    Threshold,
)
from kvctl.api import AlertSettings

MIN_FREE_PAGES = 16
"""Fragmentation of fewer free pages than this says nothing (the default `min_free_pages`)."""
DEFRAG_RECENT_S = 600.0
"""A defrag within this many seconds counts as "ran recently" (the rule file's `[10m]`)."""
DEFAULT_RUNBOOK_BASE = "docs/alerts.md"
"""Where `runbook_url` points: the runbook in this repository, one anchor per alert. Give the
evaluator and `kvctl alerts rules` an absolute URL (a published copy) for clickable links."""
AGENT_JOB = "kvctl-agent"
"""The Prometheus job that scrapes agents (agent/prometheus-scrape.yml, the PodMonitor)."""

FORMATS: dict[str, tuple] = {
    # name: (agent-side formatter, Prometheus template function)
    "percent": (text.percent, "humanizePercentage"),
    "ratio": (text.ratio, 'printf "%.2f"'),
    "count": (text.count, 'printf "%.0f"'),
    "rate": (text.rate, 'printf "%.1f"'),
}


def _in_use_at(utilization: float) -> str:
    """PromQL of the pool size at which what is in use fills `utilization` of it, at most the
    current capacity and at least one page (the agent rounds up to whole segments)."""
    in_use = "(kvctl_pool_used_pages{$SEL} + kvctl_pool_cached_pages{$SEL})"
    target = f"clamp_min(ceil({in_use} / {utilization}), 1)"
    return f"({target} < kvctl_pool_capacity_pages{{$SEL}} or kvctl_pool_capacity_pages{{$SEL}})"


FACTS: dict[str, Fact] = {
    "free_pages": Fact(lambda s: s.free_pages, "kvctl_pool_free_pages{$SEL}", "count"),
    "free_extents": Fact(lambda s: s.free_extents, "kvctl_pool_free_extents{$SEL}", "count"),
    "capacity_pages": Fact(lambda s: s.capacity_pages, "kvctl_pool_capacity_pages{$SEL}", "count"),
    "used_pages": Fact(lambda s: s.used_pages, "kvctl_pool_used_pages{$SEL}", "count"),
    "cached_pages": Fact(lambda s: s.cached_pages, "kvctl_pool_cached_pages{$SEL}", "count"),
    "requests_waiting": Fact(lambda s: s.requests_waiting, "kvctl_requests_waiting{$SEL}", "count"),
    "utilization": Fact(
        lambda s: s.utilization_ratio, "kvctl_pool_utilization_ratio{$SEL}", "percent"
    ),
    "alloc_failures_total": Fact(
        lambda s: s.alloc_failures_total, "kvctl_alloc_failures_total{$SEL}", "count"
    ),
    "grow_pages": Fact(
        lambda s: text.grow_target(s) or text.raised_limit(s),
        f"ceil(kvctl_pool_capacity_pages{{$SEL}} * {text.GROW_FACTOR})",
        "count",
    ),
    "shrink_pages": Fact(text.shrink_target, _in_use_at(text.SHRINK_TARGET_UTILIZATION), "count"),
    "trim_pages": Fact(text.trim_target, _in_use_at(text.TRIM_TARGET_UTILIZATION), "count"),
}


def runbook_url(base: str, anchor: str) -> str:
    return f"{base}#{anchor}"


# ---- what each alert measures ---------------------------------------------------------------


def _alloc_success(o: Observation) -> list[Reading]:
    ratio = o.snapshot.alloc_success_ratio
    return [] if ratio is None else [Reading(ratio)]


def _fragmentation(o: Observation) -> list[Reading]:
    s = o.snapshot
    return [Reading(s.fragmentation_ratio)] if s.free_pages >= MIN_FREE_PAGES else []


def _fragmentation_after_defrag(o: Observation) -> list[Reading]:
    age = o.snapshot.last_defrag_age_seconds
    recent = age is not None and age <= DEFRAG_RECENT_S
    return _fragmentation(o) if recent else []


def _utilization(o: Observation) -> list[Reading]:
    return [Reading(o.snapshot.utilization_ratio)]


def _prefix_hit(o: Observation) -> list[Reading]:
    s = o.snapshot
    if not s.prefix_cache_enabled or s.prefix_hit_ratio is None:
        return []
    return [Reading(s.prefix_hit_ratio)]


def _preemptions(o: Observation) -> list[Reading]:
    rate = o.preemptions_per_minute
    return [] if rate is None else [Reading(rate)]


def _gpu_memory(o: Observation) -> list[Reading]:
    return [
        Reading(g.used_bytes / g.total_bytes, (("gpu", str(g.index)),))
        for g in o.snapshot.gpus
        if g.total_bytes > 0
    ]


# ---- remediations Prometheus can give (it sees metrics, not the agent's state) -------------


def _grow_remediation(_: AlertSettings) -> str:
    auto = text.patch(
        text.setting("resize.enabled", True),
        text.setting("resize.high_water", causes.RESIZE_HIGH_WATER),
    )
    resize = text.command("{agent}", "pool resize --pages {grow_pages}")
    return f"Grow the pool: {resize} (within its `--max-pool-pages`); to grow on demand, {auto}"


def _defrag_remediation(settings: AlertSettings) -> str:
    lower = causes.lower_fragmentation_threshold(settings.fragmentation_max)
    keep_low = text.patch(
        text.setting("defrag.enabled", True),
        text.setting("defrag.fragmentation_threshold", lower),
    )
    return f"Run {text.command('{agent}', 'defrag --now')}; to keep it low, {keep_low}"


def _defrag_ineffective_remediation(settings: AlertSettings) -> str:
    lower = causes.lower_fragmentation_threshold(settings.fragmentation_max)
    sooner = text.patch(
        text.setting("defrag.check_interval_s", causes.DEFRAG_CHECK_INTERVAL_S),
        text.setting("defrag.fragmentation_threshold", lower),
    )
    return (
        f"Run a full pass with {text.command('{agent}', 'defrag --now')} and compare "
        f"fragmentation before and after in its output; if it regrows, {sooner}"
    )


def _shrink_remediation(_: AlertSettings) -> str:
    resize = text.command("{agent}", "pool resize --pages {shrink_pages}")
    auto = text.patch(text.setting("resize.enabled", True))
    return f"Shrink the pool: {resize}; to shrink automatically, {auto}"


def _prefix_remediation(_: AlertSettings) -> str:
    lfu = text.patch(text.setting("prefix_cache.eviction_policy", "lfu"))
    resize = text.command("{agent}", "pool resize --pages {grow_pages}")
    return (
        "Make shared prompt prefixes byte-identical and keep one `cache_salt` per tenant; if the "
        f"pool evicts them first, {lfu} or grow it with {resize}"
    )


def _gpu_remediation(_: AlertSettings) -> str:
    resize = text.command("{agent}", "pool resize --pages {trim_pages}")
    return (
        f"Give back the KV pool's spare pages: {resize}, or restart the agent with "
        f"`--gpu-memory-fraction {causes.GPU_MEMORY_FRACTION}`; check `nvidia-smi` for other "
        "processes on GPU {gpu}"
    )


# ---- the table ------------------------------------------------------------------------------

DEFINITIONS: tuple[AlertDefinition, ...] = (
    AlertDefinition(
        name="KvctlAllocationFailures",
        severity="critical",
        summary="KV page allocations fail on pool {pool} at {instance}",
        threshold=Threshold("alloc_success_min", above=False, margin=0.005),
        measure=_alloc_success,
        value_format="percent",
        promql="kvctl:alloc_success:ratio_rate5m",
        headline=(
            "{value} of page allocations succeeded recently "
            "({alloc_failures_total} failed since the agent started)"
        ),
        causes=causes.ALLOCATION_FAILURES,
        rule_remediation=_grow_remediation,
    ),
    AlertDefinition(
        name="KvctlFragmentationHigh",
        severity="warning",
        summary="KV pool {pool} at {instance} is fragmented",
        threshold=Threshold("fragmentation_max", above=True, margin=0.1),
        measure=_fragmentation,
        value_format="ratio",
        promql="kvctl_pool_fragmentation_ratio",
        promql_gate=(f"kvctl_pool_free_pages >= {MIN_FREE_PAGES}",),
        headline="fragmentation {value} with {free_pages} free pages in {free_extents} extents",
        causes=causes.FRAGMENTATION_HIGH,
        rule_remediation=_defrag_remediation,
    ),
    AlertDefinition(
        name="KvctlDefragIneffective",
        severity="warning",
        summary="Defragmentation does not bring down fragmentation of pool {pool} at {instance}",
        threshold=Threshold("fragmentation_max", above=True, margin=0.1),
        measure=_fragmentation_after_defrag,
        value_format="ratio",
        promql="kvctl_pool_fragmentation_ratio",
        promql_gate=(
            f"kvctl_pool_free_pages >= {MIN_FREE_PAGES}",
            "kvctl:defrag_runs:increase10m > 0",
        ),
        headline=(
            "fragmentation still {value} ({free_pages} free pages in {free_extents} extents) "
            "although defrag ran in the last 10 min"
        ),
        causes=causes.DEFRAG_INEFFECTIVE,
        rule_remediation=_defrag_ineffective_remediation,
    ),
    AlertDefinition(
        name="KvctlPoolNearlyFull",
        severity="warning",
        summary="KV pool {pool} at {instance} is nearly full",
        threshold=Threshold("utilization_high", above=True, margin=0.05),
        measure=_utilization,
        value_format="percent",
        promql="kvctl_pool_utilization_ratio",
        headline=(
            "pool {value} full: {used_pages} used and {cached_pages} cached of "
            "{capacity_pages} pages"
        ),
        causes=causes.POOL_NEARLY_FULL,
        rule_remediation=_grow_remediation,
    ),
    AlertDefinition(
        name="KvctlPoolOverProvisioned",
        severity="info",
        summary="KV pool {pool} at {instance} is mostly unused",
        threshold=Threshold("utilization_low", above=False, margin=0.05),
        measure=_utilization,
        value_format="percent",
        promql="kvctl_pool_utilization_ratio",
        headline="only {value} of the pool's {capacity_pages} pages in use",
        causes=causes.POOL_OVER_PROVISIONED,
        rule_remediation=_shrink_remediation,
        for_scale=30.0,
    ),
    AlertDefinition(
        name="KvctlPrefixHitRateLow",
        severity="info",
        summary="Prefix cache of pool {pool} at {instance} rarely hits",
        threshold=Threshold("prefix_hit_min", above=False, margin=0.05),
        measure=_prefix_hit,
        value_format="percent",
        promql="kvctl:prefix_hit:ratio_rate5m",
        headline="the prefix cache found {value} of the prompt tokens looked up recently",
        causes=causes.PREFIX_HIT_RATE_LOW,
        rule_remediation=_prefix_remediation,
        for_scale=10.0,
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
        promql="kvctl:preemptions:rate5m * 60",
        headline=(
            "{value} preemptions per minute with the pool {utilization} full and "
            "{requests_waiting} requests waiting"
        ),
        causes=causes.PREEMPTION_STORM,
        rule_remediation=_grow_remediation,
    ),
    AlertDefinition(
        name="KvctlGpuMemoryNearCapacity",
        severity="warning",
        summary="GPU memory at {instance} (pool {pool}) is nearly full",
        threshold=Threshold("gpu_memory_max", above=True, margin=0.05),
        measure=_gpu_memory,
        value_format="percent",
        promql="kvctl:gpu_memory:ratio",
        headline="GPU {gpu} memory {value} used",
        causes=causes.GPU_MEMORY_NEAR_CAPACITY,
        rule_remediation=_gpu_remediation,
        labels=("gpu",),
    ),
)

AGENT_DOWN = RuleOnlyAlert(
    name="KvctlAgentDown",
    severity="critical",
    expr='up{{job="{job}"}} == 0',
    summary="kvctl agent {instance} is down",
    description=(
        "Prometheus cannot scrape the kvctl agent at {instance} (job {job}): it is stopped, "
        "crashed or unreachable, so its pool's metrics and alerts are missing"
    ),
    remediation=(
        "Check the process: `systemctl status kvctl-agent` and `journalctl -u kvctl-agent -n 50`"
        " (Kubernetes: `kubectl -n kvctl logs ds/kvctl-agent`); once it runs, "
        f"{text.command('{agent}', 'status')} answers"
    ),
)

ALL_ALERT_NAMES: tuple[str, ...] = (*(d.name for d in DEFINITIONS), AGENT_DOWN.name)
