"""The agent's HTTP API as pydantic models: the one description the server, the client, the CLI
and the TUI share.

The server validates every body against these models (unknown fields are refused, so a typo is
an error rather than a silently ignored setting) and FastAPI publishes them in `/openapi.json`;
`kvctl.client` parses every response with them. Nothing here imports torch or the agent, so the
CLI stays fast to start.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvctl.settings import AlertSettings as AlertSettings
from kvctl.settings import DefragSettings as DefragSettings
from kvctl.settings import PrefixSettings as PrefixSettings
from kvctl.settings import ResizeSettings as ResizeSettings
from kvctl.settings import RuntimeSettings as RuntimeSettings

API_VERSION = "v1"
DEFAULT_PORT = 8477
MAX_COMPLETION_TOKENS = 4096
"""Upper bound of `max_tokens` in one completion (the agent may set a lower one)."""
MAX_STOP_STRINGS = 16
"""Stop strings one request may give (OpenAI allows 4; some frameworks send a few more)."""
MAX_STOP_LENGTH = 256
"""Characters in one stop string. With the count, this bounds the per-token cost of matching."""


class Strict(BaseModel):
    """Request bodies: unknown fields are an error, and types are strict (a boolean is not a
    number, 2.0 is not an integer, numbers are finite)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


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

    `utilization_ratio` is (used + cached) / capacity: how much of the pool holds K/V at all.
    `pressure_ratio` is used / capacity: cached prefix pages are evicted on demand, so they are
    as good as free for admission, and only this ratio says how close the pool is to refusing.
    `queue_stalled_seconds` is how long requests have been waiting while no token was produced
    and no request was admitted or refused (0 when nothing waits or the queue moved).
    `reserved_pages` are free pages set aside, right after a running sequence's last page, for
    its next ones; they are part of `free_pages`, any allocation that needs them takes them
    back, and `fragmentation_ratio`, `free_extents` and `largest_free_run` describe the free
    pages apart from them.
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
    reserved_pages: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
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
    # pressure: cached pages are reclaimable, so only used pages count
    pressure_ratio: float = 0.0
    # the queue: its cap, the age of its oldest request, and how long it has not moved
    max_waiting: int = 0
    oldest_waiting_seconds: float = 0.0
    queue_stalled_seconds: float = 0.0
    # allocations within the window (the success ratio's numerator and denominator)
    window_alloc_attempts: int = 0
    window_alloc_failures: int = 0
    requests_finished_total: dict[str, int] = {}
    requests_rejected_total: dict[str, int] = {}
    admin_actions_total: dict[str, int] = {}


PageStateName = Literal["free", "used", "cached"]


class PoolMap(Response):
    """GET /v1/pool/map: every page's state, run-length encoded as [state, start, length].

    `pool` is the pool's snapshot taken between the same two engine steps as the page states,
    so a view showing both never shows, say, requests running next to a map with no page used.
    """

    capacity_pages: int
    segment_pages: int
    runs: list[tuple[PageStateName, int, int]]
    pool: PoolSnapshot | None = None


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
# The settings are defined in kvctl.settings (one definition for the API, the TOML file, the
# flags and the docs); they are part of the API and re-exported here.


class RuntimeSettingsPatch(Strict):
    """PATCH body: any subset of the sections, each any subset of its settings (`null` restores
    a default). The agent checks the values strictly against `kvctl.settings`."""

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

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stop(cls, value: object) -> object:
        """At most `MAX_STOP_STRINGS` non-empty strings of `MAX_STOP_LENGTH` characters: the
        cost of matching them is paid on every token of every request in the batch."""
        strings = [value] if isinstance(value, str) else value
        if value is None or not isinstance(strings, list):
            return value  # None, or a type error reported by the field's own validation
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        for string in strings:
            if isinstance(string, str) and not 0 < len(string) <= MAX_STOP_LENGTH:
                raise ValueError(
                    f"a stop string has 1 to at most {MAX_STOP_LENGTH} characters, "
                    f"got one of {len(string)}"
                )
        return value


RejectReason = Literal["queue_full", "too_large", "invalid", "shutting_down"]
"""Why a request was refused before it was queued (`requests_rejected_total`): `queue_full`,
429, the queue is at --max-waiting; `too_large`, its prompt plus max_tokens can never fit the pool
or the model's context; `invalid`, a limit on the input (prompt bytes or tokens, `max_tokens`);
`shutting_down`, 503 while the agent drains."""

AdminAction = Literal["defrag", "resize", "config", "alert_test"]
"""The audited mutations (`admin_actions_total`)."""

FinishReasonName = Literal["stop", "length", "abort", "capacity"]
"""`stop`: EOS or a stop string; `length`: max_tokens or the model's context was reached (never
anything else); `abort`: the client went away or the agent shut down; `capacity`: the request
lost its pages and the pool can no longer hold it (the agent's resize and admission rules keep
this from happening; it is reported, never silent, if it does)."""


class CompletionChoice(Response):
    index: int = 0
    text: str
    finish_reason: FinishReasonName | None
    logprobs: None = None
    token_ids: list[int] | None = None
    finish_detail: str | None = None  # why a request ended early ("abort", "capacity")


class PromptTokensDetails(Response):
    cached_tokens: int


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # present when the agent runs with --report-cached-tokens (it reveals other users' prefixes)
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
