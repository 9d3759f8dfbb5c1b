"""The section models: each field is the whole definition of one runtime setting (type,
default, range, unit, help, optional flag)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Unit = Literal["", "ratio", "seconds", "pages", "extents", "per minute", "tokens"]


def setting(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    le: float | None = None,
    unit: Unit = "",
    flag: str | None = None,
) -> Any:
    """A setting's field: default, range, unit, help and optional `kvctl-agent` flag."""
    extra: dict[str, Any] = {"unit": unit}
    if flag:
        extra["flag"] = flag
    return Field(default, ge=ge, le=le, description=help, json_schema_extra=extra)


class Section(BaseModel):
    """One section of settings: strict types, finite numbers, no unknown keys, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class DefragSettings(Section):
    enabled: bool = setting(True, "Defragment automatically (thresholds below).")
    fragmentation_threshold: float = setting(
        0.5, "Start a run when fragmentation exceeds this.", ge=0.0, le=1.0, unit="ratio"
    )
    fragmentation_target: float = setting(
        0.1,
        "Stop a run once fragmentation is at or below this (at most the threshold).",
        ge=0.0,
        le=1.0,
        unit="ratio",
    )
    max_free_extents: int = setting(
        64,
        "Start a run when free space is split into more runs than this.",
        ge=1,
        le=1 << 30,
        unit="extents",
    )
    on_contiguous_miss: bool = setting(
        True, "Start a run when a prompt could not get one contiguous run of pages."
    )
    min_free_pages: int = setting(
        16,
        "Ignore fragmentation while fewer pages than this are free.",
        ge=1,
        le=1 << 40,
        unit="pages",
    )
    check_interval_s: float = setting(
        5.0, "How often the thresholds are checked.", ge=0.1, le=3600.0, unit="seconds"
    )
    step_max_pages: int = setting(
        64, "Most pages one step of a run moves.", ge=1, le=1 << 20, unit="pages"
    )
    step_max_seconds: float = setting(
        0.005,
        "Time budget of one step of a run, taken between two decode steps.",
        ge=0.0001,
        le=1.0,
        unit="seconds",
    )

    @model_validator(mode="after")
    def _ordered(self) -> DefragSettings:
        if self.fragmentation_target > self.fragmentation_threshold:
            raise SettingsError(
                "defrag.fragmentation_target",
                f"must not exceed defrag.fragmentation_threshold ({self.fragmentation_threshold})",
            )
        return self


class ResizeSettings(Section):
    """Automatic resize: grow one segment above `high_water` utilisation held for `window_s`,
    shrink one segment below `low_water` held for `window_s`, within [min_pages, max_pages].
    The limits also bound manual resizes."""

    enabled: bool = setting(False, "Grow and shrink the pool automatically.")
    high_water: float = setting(
        0.9,
        "Grow when utilisation stays above this for a window.",
        ge=0.0,
        le=1.0,
        unit="ratio",
    )
    low_water: float = setting(
        0.3,
        "Shrink when utilisation stays below this for a window.",
        ge=0.0,
        le=1.0,
        unit="ratio",
    )
    window_s: float = setting(
        60.0,
        "How long a water mark must hold before a resize.",
        ge=1.0,
        le=86400.0,
        unit="seconds",
    )
    min_pages: int | None = setting(
        None,
        "Smallest pool a resize may leave (default: one segment).",
        ge=1,
        le=1 << 40,
        unit="pages",
    )
    max_pages: int | None = setting(
        None,
        "Largest pool a resize may make; never above --max-pool-pages (the default).",
        ge=1,
        le=1 << 40,
        unit="pages",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ResizeSettings:
        if self.low_water >= self.high_water:
            raise SettingsError(
                "resize.low_water", f"must be below resize.high_water ({self.high_water})"
            )
        if self.min_pages and self.max_pages and self.min_pages > self.max_pages:
            raise SettingsError(
                "resize.min_pages", f"must not exceed resize.max_pages ({self.max_pages})"
            )
        return self


class PrefixSettings(Section):
    eviction_policy: Literal["lru", "lfu", "fifo"] = setting(
        "lru",
        "Which cached prefix pages go first when pages run short.",
        flag="--eviction-policy",
    )
    host_tier_policy: Literal["lru", "lfu", "fifo"] = setting(
        "lru",
        "Which pages the host tier drops (or moves to disk) first when it needs room.",
        flag="--host-tier-policy",
    )
    disk_tier_policy: Literal["lru", "lfu", "fifo"] = setting(
        "lru",
        "Which page files the disk tier deletes first when it needs room.",
        flag="--disk-tier-policy",
    )
    max_pinned_share: float = setting(
        0.25,
        "The most of the pool pinned prefixes may hold (kvctl prefix pin); a pin past it is "
        "refused, so pins never starve the requests they are meant to speed up.",
        ge=0.0,
        le=0.9,
        unit="ratio",
        flag="--max-pinned-share",
    )
    tier_min_load_tokens: int = setting(
        0,
        "Prefixes found below the device that are shorter than this are computed, not loaded "
        "(when a tier loads slower than the model computes short prompts).",
        ge=0,
        le=1 << 20,
        unit="tokens",
    )


class AlertSettings(Section):
    """Thresholds of the agent's own alert evaluation (docs/alerts.md). A threshold no value
    can cross (a minimum of 0, a maximum ratio of 1) turns its alert off."""

    interval_s: float = setting(
        15.0,
        "How often the agent evaluates its alerts.",
        ge=1.0,
        le=3600.0,
        unit="seconds",
        flag="--alert-interval",
    )
    for_s: float = setting(
        60.0,
        "How long a condition holds before its alert fires (some alerts scale it).",
        ge=0.0,
        le=86400.0,
        unit="seconds",
        flag="--alert-for",
    )
    alloc_success_min: float = setting(
        1.0,
        "Warn when allocation success over the window is below this (with at least "
        "alloc_failures_min failures in the window).",
        ge=0.0,
        le=1.0,
        unit="ratio",
    )
    alloc_failures_min: int = setting(
        5,
        "Failed allocations in the window before allocation failures alert at all: one "
        "failure is not a trend.",
        ge=1,
        le=1_000_000_000,
    )
    alloc_failure_critical: float = setting(
        0.05,
        "Allocation failures are critical when at least this share of the window's "
        "allocations failed (with at least alloc_attempts_min attempts).",
        ge=0.0001,
        le=1.0,
        unit="ratio",
    )
    alloc_attempts_min: int = setting(
        100,
        "Allocations in the window before their failure share can make the alert critical.",
        ge=1,
        le=1_000_000_000,
    )
    fragmentation_max: float = setting(
        0.5, "Alert when fragmentation stays above this.", ge=0.0, le=1.0, unit="ratio"
    )
    pressure_high: float = setting(
        0.95,
        "Alert when pages held by running requests exceed this share of the pool (cached "
        "prefix pages are reclaimable and do not count).",
        ge=0.0,
        le=1.0,
        unit="ratio",
    )
    utilization_low: float = setting(
        0.2,
        "Alert when used and cached pages stay below this share of the pool.",
        ge=0.0,
        le=1.0,
        unit="ratio",
    )
    prefix_hit_min: float = setting(
        0.1,
        "Alert when the prefix hit rate over the window is below this.",
        ge=0.0,
        le=1.0,
        unit="ratio",
    )
    pinned_share_max: float = setting(
        0.2,
        "Alert when pinned prefixes hold more than this share of the pool while requests wait.",
        ge=0.0,
        le=1.0,
        unit="ratio",
    )
    preemptions_per_minute_max: float = setting(
        30.0,
        "Alert when preemptions per minute exceed this.",
        ge=0.0,
        le=1e6,
        unit="per minute",
    )
    gpu_memory_max: float = setting(
        0.95, "Alert when a GPU's memory is fuller than this.", ge=0.0, le=1.0, unit="ratio"
    )
    queue_stalled_max_s: float = setting(
        30.0,
        "Alert when requests have waited this long with no token produced and none admitted "
        "or refused.",
        ge=1.0,
        le=86400.0,
        unit="seconds",
    )
    queue_wait_max_s: float = setting(
        60.0,
        "Alert when the oldest waiting request has waited longer than this.",
        ge=1.0,
        le=86400.0,
        unit="seconds",
    )
    tier_reuse_min: float = setting(
        0.05,
        "Alert when a tier loads back fewer pages than this share of the pages it stores over "
        "the window (with at least tier_stores_min stores): it costs memory and copies for "
        "nothing.",
        ge=0.0,
        le=1.0,
        unit="ratio",
    )
    tier_stores_min: int = setting(
        64,
        "Pages a tier must store in the window before its reuse can alert: a tier filling up "
        "after a start is not a trend.",
        ge=1,
        le=1_000_000_000,
        unit="pages",
    )
    tier_load_cost_max: float = setting(
        1.0,
        "Alert when loading a prompt token from a tier takes longer than this many times the "
        "time computing it takes (prefill seconds per token), over the window.",
        ge=0.01,
        le=1000.0,
    )
    tier_loads_min: int = setting(
        16,
        "Pages a tier must load in the window before its load time can alert.",
        ge=1,
        le=1_000_000_000,
        unit="pages",
    )
    tier_store_failures_max: int = setting(
        0,
        "Alert when more pages than this failed to be stored into a tier over the window.",
        ge=0,
        le=1_000_000_000,
        unit="pages",
    )
    disk_tier_free_min: float = setting(
        1.0,
        "Alert when the disk tier's filesystem has less free space than this share of what "
        "the tier may still fill (capacity - used bytes): its stores would start failing.",
        ge=0.0,
        le=100.0,
    )
    budget_room_segments_min: int = setting(
        1,
        "Alert when a pool sharing a KV budget is under pressure, no pool can give it memory "
        "and the budget has less unassigned room than this many of the pool's segments: only "
        "a restart with a larger --kv-budget or fewer models adds memory (0 turns it off).",
        ge=0,
        le=1_000_000,
    )


class RebalanceSettings(Section):
    """Moving memory between the pools of one budget (several models on one agent): a pool
    under pressure for `pressure_s` takes segments from the unassigned budget, then from pools
    that have been calm for `calm_s`; after a move neither side moves the other way for
    `cooldown_s`, so pools do not trade memory back and forth. A pool below its share that
    stays under pressure for `reclaim_s` takes its memory back from busy borrowers too."""

    enabled: bool = setting(True, "Move memory between the pools of one budget.")
    pressure_s: float = setting(
        1.0,
        "How long a pool must stay under pressure (requests waiting for pages, failed "
        "allocations, preemptions) before it takes memory.",
        ge=0.0,
        le=3600.0,
        unit="seconds",
    )
    calm_s: float = setting(
        10.0,
        "How long a pool must stay free of pressure before it gives memory.",
        ge=0.0,
        le=86400.0,
        unit="seconds",
    )
    cooldown_s: float = setting(
        30.0,
        "After a move, how long the taker may not give and the donor may not take.",
        ge=0.0,
        le=86400.0,
        unit="seconds",
    )
    headroom_ratio: float = setting(
        1.0,
        "Share of its peak use a donor keeps free beyond it: 1 keeps twice the most pages it "
        "used within `peak_window_s`.",
        ge=0.0,
        le=10.0,
        unit="ratio",
    )
    peak_window_s: float = setting(
        20.0,
        "How far back a donor's peak use counts: it never gives pages it needed this recently.",
        ge=0.0,
        le=86400.0,
        unit="seconds",
    )
    reclaim_s: float = setting(
        2.0,
        "How long a pool below its share (the pages it started with) must stay under pressure "
        "before it takes back what it lent from pools above theirs, busy or not: they evict "
        "cached pages and, if they must, preempt their youngest requests.",
        ge=0.0,
        le=3600.0,
        unit="seconds",
    )


class ChatSettings(Section):
    """How /v1/chat/completions turns a conversation into tokens (docs/security.md)."""

    special_tokens_in_content: Literal["plain", "raw"] = setting(
        "plain",
        "How special-token text inside a message (`<|im_end|>`) is tokenized: `plain` reads it "
        "as text, so only the chat template writes control tokens and a message cannot open "
        "another turn; `raw` reads it as the special token, as transformers' "
        "apply_chat_template does.",
    )


class SleepSettings(Section):
    """Models that fall asleep by themselves: one that has had no request for `idle_s` sleeps at
    `level`, releasing its KV pool to the budget (level 2 drops its weights too); the next
    request wakes it. The agent's last awake model never falls asleep by itself."""

    idle_s: float | None = setting(
        None,
        "Seconds without a request after which a model sleeps by itself (null: never).",
        ge=1.0,
        le=7 * 86400.0,
        unit="seconds",
        flag="--sleep-when-idle",
    )
    level: int = setting(
        1,
        "The level an idle model sleeps at: 1 keeps its weights in host memory, 2 drops them "
        "and reloads them from the checkpoint when it wakes.",
        ge=1,
        le=2,
        flag="--idle-sleep-level",
    )


class RuntimeSettings(Section):
    """GET/PATCH /v1/config: what can change while the agent runs."""

    defrag: DefragSettings = DefragSettings()
    resize: ResizeSettings = ResizeSettings()
    prefix_cache: PrefixSettings = PrefixSettings()
    alerts: AlertSettings = AlertSettings()
    rebalance: RebalanceSettings = RebalanceSettings()
    chat: ChatSettings = ChatSettings()
    sleep: SleepSettings = SleepSettings()


def _section_type(name: str, annotation: object) -> type[Section]:
    if not (isinstance(annotation, type) and issubclass(annotation, Section)):
        raise TypeError(f"runtime setting {name!r} is not a section")
    return annotation


SECTIONS: dict[str, type[Section]] = {
    name: _section_type(name, field.annotation)
    for name, field in RuntimeSettings.model_fields.items()
}


class SettingsError(ValueError):
    """A refused setting; `key` is `section.name` and the message says what is allowed."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem
