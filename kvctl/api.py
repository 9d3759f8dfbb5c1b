"""The agent's HTTP API as pydantic models: the one description the server, the client, the CLI
and the TUI share.

The server validates every body against these models (unknown fields are refused, so a typo is
an error rather than a silently ignored setting) and FastAPI publishes them in `/openapi.json`;
`kvctl.client` parses every response with them. Nothing here imports torch or the agent, so the
CLI stays fast to start.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

API_VERSION = "v1"
DEFAULT_PORT = 8477
MAX_COMPLETION_TOKENS = 4096
"""Upper bound of `max_tokens` in one completion (the agent may set a lower one)."""


class Strict(BaseModel):
    """Request bodies: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid")


class Response(BaseModel):
    """Response bodies: a newer agent may add fields, an older client ignores them."""

    model_config = ConfigDict(extra="ignore")


# ---- errors ---------------------------------------------------------------------------------


class ErrorDetail(Response):
    message: str
    type: str  # "invalid_request_error", "unauthorized", "conflict", "not_found", ...
    code: int


class ErrorBody(Response):
    """Every 4xx/5xx answer: `{"error": {"message", "type", "code"}}`, as OpenAI's API does."""

    error: ErrorDetail


# ---- health and models ----------------------------------------------------------------------


class Health(Response):
    status: Literal["ok"]
    pool: str
    version: str
    uptime_seconds: float


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvctl"


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- pool -----------------------------------------------------------------------------------


class GpuMemory(Response):
    """One GPU as NVML and torch's caching allocator see it (absent fields: not measurable)."""

    index: int
    name: str
    used_bytes: int
    total_bytes: int
    torch_reserved_bytes: int | None = None
    torch_allocated_bytes: int | None = None
    torch_inactive_split_bytes: int | None = None


class DefragResult(Response):
    """What one defragmentation did (POST /v1/defrag, and the last run in /v1/pool)."""

    trigger: str
    fragmentation_before: float
    fragmentation_after: float
    free_extents_before: int
    free_extents_after: int
    pages_moved: int
    bytes_moved: int
    seconds: float
    complete: bool


class PoolSnapshot(Response):
    """GET /v1/pool: one consistent reading of the pool, the scheduler and the counters.

    Ratios are 0..1. `*_total` fields are counters since the agent started; `*_ratio` fields
    named after a window (`alloc_success_ratio`, `prefix_hit_ratio`) cover the last
    `window_seconds`, and are null when nothing happened in it.
    """

    pool: str
    timestamp: float
    device: str
    page_size: int
    bytes_per_page: int
    segment_pages: int
    segments: int
    capacity_pages: int
    used_pages: int
    cached_pages: int
    free_pages: int
    capacity_bytes: int
    used_bytes: int
    utilization_ratio: float
    fragmentation_ratio: float
    free_extents: int
    largest_free_run: int
    max_pool_pages: int | None
    alloc_attempts_total: int
    alloc_failures_total: int
    alloc_success_ratio: float | None
    window_seconds: float
    prefix_cache_enabled: bool
    prefix_queries_tokens_total: int
    prefix_hits_tokens_total: int
    prefix_hit_ratio: float | None
    prefix_evictions_total: int
    defrag_runs_total: dict[str, int]
    defrag_pages_moved_total: int
    defrag_active: bool
    last_defrag: DefragResult | None
    last_defrag_age_seconds: float | None
    auto_defrag_enabled: bool
    resizes_total: dict[str, int]
    requests_running: int
    requests_waiting: int
    preemptions_total: int
    alert_notifications_dropped_total: int = 0
    gpus: list[GpuMemory]


PageStateName = Literal["free", "used", "cached"]


class PoolMap(Response):
    """GET /v1/pool/map: every page's state, run-length encoded as [state, start, length]."""

    capacity_pages: int
    segment_pages: int
    runs: list[tuple[PageStateName, int, int]]


class DefragRequest(Strict):
    max_pages: Annotated[int, Field(ge=1, le=1 << 40)] | None = None


class ResizeRequest(Strict):
    """Exactly one of `pages` or `bytes`; the size is rounded up to whole segments."""

    pages: Annotated[int, Field(ge=1, le=1 << 40)] | None = None
    bytes: Annotated[int, Field(ge=1, le=1 << 60)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ResizeRequest:
        if (self.pages is None) == (self.bytes is None):
            raise ValueError("give exactly one of `pages` or `bytes`")
        return self


class ResizeResult(Response):
    old_pages: int
    new_pages: int
    old_bytes: int
    new_bytes: int
    direction: Literal["grow", "shrink", "none"]
    pages_moved: int
    pages_evicted: int


# ---- alerts ---------------------------------------------------------------------------------


class Alert(Response):
    """An alert the agent evaluates; `state` is pending until its `for` duration has passed."""

    name: str
    severity: Literal["info", "warning", "critical"]
    state: Literal["pending", "firing"]
    value: float | None
    summary: str
    description: str
    remediation: str
    runbook_url: str
    active_since: float
    labels: dict[str, str] = {}


class AlertList(Response):
    alerts: list[Alert]


# ---- runtime configuration ------------------------------------------------------------------

Ratio = Annotated[float, Field(ge=0.0, le=1.0)]
PositiveSeconds = Annotated[float, Field(gt=0.0, le=86400.0)]


class DefragSettings(Strict):
    enabled: bool = True
    fragmentation_threshold: Ratio = 0.5
    fragmentation_target: Ratio = 0.1
    max_free_extents: Annotated[int, Field(ge=1)] = 64
    on_contiguous_miss: bool = True
    min_free_pages: Annotated[int, Field(ge=1)] = 16
    check_interval_s: PositiveSeconds = 5.0
    step_max_pages: Annotated[int, Field(ge=1, le=1 << 20)] = 64
    step_max_seconds: PositiveSeconds = 0.005

    @model_validator(mode="after")
    def _ordered(self) -> DefragSettings:
        if self.fragmentation_target > self.fragmentation_threshold:
            raise ValueError("fragmentation_target must not exceed fragmentation_threshold")
        return self


class ResizeSettings(Strict):
    """Automatic resize: grow one segment above `high_water` utilisation held for `window_s`,
    shrink one segment below `low_water` held for `window_s`, within [min_pages, max_pages]."""

    enabled: bool = False
    high_water: Ratio = 0.9
    low_water: Ratio = 0.3
    window_s: PositiveSeconds = 60.0
    min_pages: Annotated[int, Field(ge=1)] | None = None
    max_pages: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _ordered(self) -> ResizeSettings:
        if self.low_water >= self.high_water:
            raise ValueError("low_water must be below high_water")
        if self.min_pages and self.max_pages and self.min_pages > self.max_pages:
            raise ValueError("min_pages must not exceed max_pages")
        return self


class PrefixSettings(Strict):
    eviction_policy: Literal["lru", "lfu", "fifo"] = "lru"


class AlertSettings(Strict):
    """Thresholds of the agent's own alert evaluation (the rule file has the same defaults)."""

    interval_s: PositiveSeconds = 15.0
    for_s: Annotated[float, Field(ge=0.0, le=86400.0)] = 60.0
    alloc_success_min: Ratio = 1.0
    fragmentation_max: Ratio = 0.5
    utilization_high: Ratio = 0.95
    utilization_low: Ratio = 0.2
    prefix_hit_min: Ratio = 0.1
    preemptions_per_minute_max: Annotated[float, Field(ge=0.0)] = 30.0
    gpu_memory_max: Ratio = 0.95


class RuntimeSettings(Strict):
    """GET/PATCH /v1/config: what can change while the agent runs."""

    defrag: DefragSettings = DefragSettings()
    resize: ResizeSettings = ResizeSettings()
    prefix_cache: PrefixSettings = PrefixSettings()
    alerts: AlertSettings = AlertSettings()


class RuntimeSettingsPatch(Strict):
    """PATCH body: any subset of the sections, each any subset of its fields."""

    defrag: dict[str, object] | None = None
    resize: dict[str, object] | None = None
    prefix_cache: dict[str, object] | None = None
    alerts: dict[str, object] | None = None


# ---- completions (OpenAI-compatible) --------------------------------------------------------


class CompletionRequest(Strict):
    """POST /v1/completions, OpenAI's fields plus `top_k`, `cache_salt`, `return_token_ids`."""

    model: str | None = None
    prompt: str | list[Annotated[int, Field(ge=0)]]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_COMPLETION_TOKENS)] = 16
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=1 << 20)] = 0
    seed: Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: Literal[1] = 1
    user: str | None = None
    cache_salt: Annotated[str, Field(max_length=256)] | None = None
    return_token_ids: bool = False
    ignore_eos: bool = False


class CompletionChoice(Response):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: None = None
    token_ids: list[int] | None = None


class PromptTokensDetails(Response):
    cached_tokens: int


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionResponse(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
