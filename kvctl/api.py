"""The agent's HTTP API as pydantic models: the one description the server, the client, the CLI
and the TUI share.

The server validates every body against these models (unknown fields are refused, so a typo is
an error rather than a silently ignored setting) and FastAPI publishes them in `/openapi.json`
(docs/api.md is that schema in prose); `kvctl.client` parses every response with them. Nothing
here imports torch or the agent, so the CLI stays fast to start.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    computed_field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvctl.occupancy import fragmentation_of as fragmentation_of
from kvctl.occupancy import free_run_pages_of, pages_bytes, pressure_of, utilization_of
from kvctl.settings import AlertSettings as AlertSettings
from kvctl.settings import ChatSettings as ChatSettings
from kvctl.settings import DefragSettings as DefragSettings
from kvctl.settings import PrefixSettings as PrefixSettings
from kvctl.settings import RebalanceSettings as RebalanceSettings
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
MAX_CHOICES = 16
"""`n` of one request; with a list of prompts, at most this many choices in all."""
MAX_PROMPTS = 16
"""Prompts in one completions request (`prompt` as a list of strings or of token-id lists)."""
MAX_MESSAGES = 1024
"""Messages in one chat request."""
MAX_LOGIT_BIAS = 1024
"""Entries of one `logit_bias` map (OpenAI allows 300; frameworks send a few more)."""
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
"""Top alternatives reported per token (chat's `top_logprobs`; completions allow 5)."""
MAX_ALLOWED_TOKEN_IDS = 4096
"""Ids in one `allowed_token_ids` list (a label set, a small vocabulary): each step of the
request writes them once into its row of the blocked-token table."""
MAX_JSON_DEPTH = 64
"""Nesting of arrays and objects in one body. The deepest body the API defines nests 5 levels;
Python's JSON parser and the validators recurse once per level, so a body nested many thousand
levels deep would exhaust the stack instead of being refused."""

POOL_REQUIRED = "pool_required"
"""The error `type` of a single-pool route on an agent serving several models (409): how a
command without `--pool` learns the agent's pools."""
UNKNOWN_POOL = "unknown_pool"
UNKNOWN_PREFIX_ITEM = "unknown_prefix_item"
"""404: no pin with that id, or nothing cached under that cache salt."""
"""The error `type` of a named pool's route for a pool the agent does not have (404), as
against a route that does not exist."""
INVALID_TEXT = "invalid_text"
"""The validation error type of a string that is not valid Unicode (a lone surrogate): a 400
naming the field (kvctl.agent.http.server)."""
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_SCALARS = frozenset({int, float, bool, type(None)})


class BadText(NamedTuple):
    """Where a parsed JSON value holds text that cannot be encoded, and why, in one line."""

    param: str
    """The field as a dotted path (`messages.0.content`); `body` for the body itself."""
    message: str


def lone_surrogate(value: object) -> BadText | None:
    """The first string (or object key) in parsed JSON holding a lone surrogate, None when all
    are valid Unicode.

    JSON may escape half of a surrogate pair alone (`"\\ud800"`) and Python's parser keeps it,
    but such a string has no UTF-8 form: tokenizing, matching or echoing it fails far from the
    request. Refusing it where the body is read gives the client its field and the fix. The walk
    uses its own stack, so no nesting can exhaust Python's."""
    pending: list[tuple[object, tuple[str | int, ...]]] = [(value, ())]
    while pending:
        item, path = pending.pop()
        if isinstance(item, str):
            if (found := _SURROGATE.search(item)) is not None:
                return _bad_text(path, "text", found)
        elif isinstance(item, list | tuple):
            if _SCALARS.issuperset(map(type, item)):
                continue  # token ids: one pass in C instead of one Python step per id
            children = [(c, (*path, i)) for i, c in enumerate(item) if type(c) not in _SCALARS]
            pending.extend(reversed(children))
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                if isinstance(key, str) and (found := _SURROGATE.search(key)) is not None:
                    return _bad_text(path, "a key", found)
                if type(child) not in _SCALARS:
                    children.append((child, (*path, key)))
            pending.extend(reversed(children))
    return None


def _bad_text(path: tuple[str | int, ...], what: str, found: re.Match[str]) -> BadText:
    param = ".".join(str(part) for part in path) or "body"
    escaped = f"\\u{ord(found.group()):04x}"
    return BadText(
        param,
        f"{param}: {what} contains a lone surrogate ({escaped}) at index {found.start()}; "
        "send valid UTF-8",
    )


class Strict(BaseModel):
    """Request bodies: unknown fields are an error, and types are strict (a boolean is not a
    number, 2.0 is not an integer, numbers are finite), and every string is valid Unicode."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        """Refuse a lone surrogate anywhere in the input (fields, list items, object keys), so
        no route tokenizes, matches or echoes text that has no UTF-8 form."""
        bad = lone_surrogate(data)
        if bad is not None:
            raise PydanticCustomError(INVALID_TEXT, "{message}", bad._asdict())
        return data


class Response(BaseModel):
    """Response bodies: a newer agent may add fields, an older client ignores them."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)


# ---- errors ---------------------------------------------------------------------------------


class ErrorDetail(Response):
    message: str
    type: str  # "invalid_request_error", "unauthorized", "conflict", "not_found", ...
    param: str | None = None
    """The request field the error is about (`prompt`, `messages.0.content`), where one is."""
    code: int


class ErrorBody(Response):
    """Every 4xx/5xx answer: `{"error": {"message", "type", "param", "code"}}`, as OpenAI's API
    does."""

    error: ErrorDetail


# ---- health and models ----------------------------------------------------------------------


class Health(Response):
    status: Literal["ok"]
    pool: str
    """The first pool's name (the only one when one model is served)."""
    version: str
    uptime_seconds: float
    pools: list[str] = []
    """Every pool, one per served model, in the order they were configured."""


Capability = Literal["completions", "chat"]
"""What a served model answers: completions always, chat when it has a chat template."""


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvctl"
    root: str | None = None
    """The served model this name is an alias of (the first `--served-model-name`)."""
    capabilities: list[Capability] = []
    """The endpoints that serve it: `chat` only when the checkpoint has a chat template."""
    max_model_len: int | None = None
    """The model's context in tokens: prompt plus output of one request."""


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

    trigger: str  # manual, threshold, extents, alloc_failure, shrink
    fragmentation_before: float
    fragmentation_after: float
    free_extents_before: int
    free_extents_after: int
    pages_moved: int
    bytes_moved: int
    seconds: float
    complete: bool


class PoolOccupancy(Response):
    """One consistent reading of a pool's pages and allocation counters: what the pool itself
    reports (its `stats()`, turned into this model by `kvctl.agent.api_views`), and the first
    part of every `PoolSnapshot`.

    The ratios and byte counts are computed from the page counts (by `kvctl.occupancy`, as the
    pool's own reading computes them), so they can never disagree with them; they are in the
    JSON, and ignored when JSON is read back.
    `reserved_pages` are free pages set aside, right after a running sequence's last page, for
    its next ones; they are part of `free_pages`, any allocation that needs them takes them
    back, and `fragmentation_ratio`, `free_extents` and `largest_free_run` describe the free
    pages apart from them (`free_run_pages`).
    """

    page_size: int
    """Tokens one page holds."""
    bytes_per_page: int
    """K and V of `page_size` tokens over every layer."""
    segment_pages: int
    """The unit of resize: the pool grows and shrinks by whole segments."""
    segments: int
    capacity_pages: int
    used_pages: int
    """Held by at least one running sequence."""
    cached_pages: int
    """Held only by the prefix cache: evicted on demand, so as good as free for admission."""
    free_pages: int
    """Free, the reserved pages included."""
    free_extents: int
    """Runs of consecutive free pages (reserved pages apart)."""
    largest_free_run: int
    reserved_pages: int = 0
    """Free pages set aside right after a running sequence's last page, for its next ones."""
    sequences: int = 0
    """Page tables in the pool: running sequences and their forks."""
    alloc_attempts_total: int
    alloc_failures_total: int
    """Allocations that failed after eviction and growth were tried."""
    contiguous_misses_total: int = 0
    """Prompts that could not get one run of pages and got scattered pages."""

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def capacity_bytes(self) -> int:
        """capacity_pages × bytes_per_page."""
        return pages_bytes(self.capacity_pages, self.bytes_per_page)

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def used_bytes(self) -> int:
        """used_pages × bytes_per_page."""
        return pages_bytes(self.used_pages, self.bytes_per_page)

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def utilization_ratio(self) -> float:
        """(used + cached) / capacity: how much of the pool holds K/V at all."""
        return utilization_of(self.used_pages, self.cached_pages, self.capacity_pages)

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def pressure_ratio(self) -> float:
        """used / capacity: cached pages are evicted on demand, so only used pages count."""
        return pressure_of(self.used_pages, self.capacity_pages)

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def free_run_pages(self) -> int:
        """Free pages in the free extents: all free pages but those reserved for growth."""
        return free_run_pages_of(self.free_pages, self.reserved_pages)

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def fragmentation_ratio(self) -> float:
        """1 - largest free run / free pages, over the free extents (`free_run_pages`)."""
        return fragmentation_of(self.largest_free_run, self.free_run_pages)


TierName = Literal["host", "disk"]


class TierReading(Response):
    """One tier below the device pool (host memory, or page files on disk): its size, what it
    holds and what it did since the agent started. Its pages are prefix-cache pages the device
    evicted; a prompt that finds them there loads them instead of computing them."""

    tier: TierName
    policy: str
    """Which page goes first when the tier needs room (lru, lfu, fifo)."""
    capacity_pages: int
    used_pages: int
    page_bytes: int
    """Bytes one page takes in this tier (on disk: its file, header included)."""
    hits_tokens_total: int
    """Prompt tokens loaded from this tier instead of computed."""
    stored_pages_total: int
    """Pages written into this tier (from the device, or from the tier above)."""
    stored_bytes_total: int
    loaded_pages_total: int
    """Pages read from this tier into the device pool."""
    loaded_bytes_total: int
    store_seconds_total: float
    load_seconds_total: float
    evicted_pages_total: int
    """Pages that left the tier to make room (to the tier below, or dropped)."""
    store_failures_total: dict[str, int]
    """Pages not stored, by reason: full (they fit in no tier: a prompt longer than the last
    tier), io (a write failed)."""
    load_failures_total: dict[str, int]
    """Pages found in the index but not usable, by reason: missing, truncated, checksum, io.
    Each is a miss: the page is computed, never served wrong."""
    path: str | None = None
    """The disk tier's directory."""
    filesystem_free_bytes: int | None = None
    """Free bytes of the filesystem holding the disk tier (null when it cannot be read)."""
    filesystem_size_bytes: int | None = None

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.page_bytes

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def load_seconds_per_token(self) -> float | None:
        """Load time per reused token since start; null before the first load."""
        return self.load_seconds_total / self.hits_tokens_total if self.hits_tokens_total else None


class PoolShare(Response):
    """A pool's place in the memory budget it shares with the agent's other pools (several
    models on one agent). Bytes of the whole budget, and this pool's floor, ceiling, pressure
    and the memory it took from or gave to the others."""

    budget_bytes: int
    """The most bytes all pools together may hold (`--kv-budget`)."""
    assigned_bytes: int
    """Bytes all pools hold now; never above `budget_bytes`."""
    floor_pages: int
    """The smallest this pool may become."""
    ceiling_pages: int
    """The largest this pool may become."""
    share_pages: int = 0
    """What this pool may always take back when it needs it, however busy the pool it lent to:
    the pages it started with, or was sized to by an operator."""
    pinned: bool = False
    """Sized by an operator: the agent neither takes memory from it nor gives it any, until
    released (`POST /v1/pools/{name}/release`)."""
    under_pressure: bool = False
    """Requests wait for pages, or allocations failed or requests were preempted lately."""
    short_pages: int = 0
    """Pages the waiting requests need beyond what is free or evictable now."""
    reclaimable_pages: int = 0
    """Pages the pool could give without touching what it uses, has promised or keeps as
    headroom (whole segments)."""
    pools_total: int = 1
    pools_under_pressure: int = 0
    """Pools of this budget under pressure now (this one included)."""
    donors: int = 0
    """Pools that could give memory now (calm, unpinned, with reclaimable segments)."""
    rebalances_total: dict[str, int] = {}
    """Moves that changed this pool: `in` (it took memory), `out` (it gave memory)."""
    rebalanced_bytes_total: dict[str, int] = {}
    """Bytes this pool took (`in`) or gave (`out`) in those moves."""

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def unassigned_bytes(self) -> int:
        """Budget no pool holds: what a pool under pressure takes first."""
        return self.budget_bytes - self.assigned_bytes


# ---- sleeping models ------------------------------------------------------------------------

SleepLevel = Literal[1, 2]
"""1: the KV pool is released and the weights kept in host memory (moved there from a GPU);
2: the weights are dropped too, and reloaded from the checkpoint on wake."""
SleepStateName = Literal["awake", "asleep", "waking"]
SleepTrigger = Literal["manual", "idle"]
WakeTrigger = Literal["manual", "request"]


class SleepRequest(Strict):
    """POST /v1/pools/{name}/sleep: release the model's KV pool (and, at level 2, its
    weights). `force` sleeps the agent's last awake model too (every request then waits for a
    wake)."""

    level: SleepLevel = 1
    force: bool = False


class SleepReading(Response):
    """Where a model stands: awake, asleep or waking (its weights loading, requests waiting)."""

    state: SleepStateName = "awake"
    level: SleepLevel | None = None
    """The level it sleeps (or slept, while waking) at; null when awake."""
    asleep_seconds: float | None = None
    """Since it fell asleep (null when awake)."""
    released_bytes: int = 0
    """Device memory the sleep gave back: the KV pool, and on a GPU the weights (0 when
    awake). On the CPU, level 2's dropped weights are host memory: `weights_released_bytes`."""
    weights_released_bytes: int = 0
    """Bytes of weights dropped (level 2) or moved off the device (level 1 on a GPU)."""
    sleeps_total: dict[str, int] = {}
    """By trigger: manual (kvctl sleep), idle (sleep.idle_s)."""
    wakes_total: dict[str, int] = {}
    """By trigger: manual (kvctl wake), request (a request for the sleeping model)."""
    last_wake_seconds: float | None = None
    """How long the last wake took: from the wake to the model's first step."""
    last_wake_error: str | None = None
    """Why the last wake failed (its checkpoint could not be loaded), until one succeeds."""


class SleepResult(Response):
    """What a sleep released."""

    pool: str
    level: SleepLevel
    trigger: SleepTrigger
    kv_bytes: int
    """The KV pool's memory given back (to the budget, or to the device)."""
    weights_bytes: int
    """Weights dropped (level 2) or moved to host memory (level 1 on a GPU; 0 on the CPU,
    where they already are)."""
    pages_evicted: int
    """Cached prefix pages evicted (down a tier where a tier's policy keeps them)."""


class WakeResult(Response):
    """A wake carried out: how long it took and the pool it has now."""

    pool: str
    woke: bool
    """False when the model was awake already (nothing done)."""
    level: SleepLevel | None
    """The level it slept at."""
    trigger: WakeTrigger
    wake_seconds: float
    capacity_pages: int
    weights_reloaded: bool


class PoolSnapshot(PoolOccupancy):
    """GET /v1/pool: one consistent reading of the pool, the scheduler and the counters.

    Ratios are 0..1. `*_total` fields are counters since the agent started; `*_ratio` fields
    named after a window (`alloc_success_ratio`, `prefix_hit_ratio`) cover the last
    `window_seconds`, and are null when nothing happened in it. `pressure_ratio`, not
    `utilization_ratio`, says how close the pool is to refusing (see `PoolOccupancy`).
    `queue_stalled_seconds` is how long requests have been waiting while no token was produced
    and no request was admitted or refused (0 when nothing waits or the queue moved).
    """

    pool: str
    """The pool's name: the model it serves (the `pool` label of every metric)."""
    timestamp: float
    """Unix time of the reading."""
    device: str
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    max_pool_pages: int | None
    """The most pages a resize may reach; null when unbounded."""
    alloc_success_ratio: float | None
    """Successful allocations ÷ attempts over the window; null when none was attempted."""
    window_seconds: float
    """The window of the `*_ratio` fields named after one."""
    prefix_cache_enabled: bool
    prefix_queries_tokens_total: int
    """Prompt tokens looked up in the prefix cache."""
    prefix_hits_tokens_total: int
    """Prompt tokens the prefix cache served (not recomputed)."""
    prefix_hit_ratio: float | None
    """Hit tokens ÷ looked-up tokens over the window; null when nothing was looked up."""
    prefix_evictions_total: int
    """Pages the prefix cache gave up to make room."""
    prefix_hits_tokens_by_tier: dict[str, int] = {}
    """`prefix_hits_tokens_total` by where the reused pages were (device, host, disk): each
    token in exactly one tier, so the values sum to the total."""
    tiers: list[TierReading] = []
    """The tiers below the device pool; empty when none is configured."""
    prefill_seconds_per_token: float | None = None
    """What computing a prompt token costs now (moving average over prompt steps of 64 tokens
    or more): a tier whose loads cost more per token does not pay for itself."""
    defrag_runs_total: dict[str, int]
    """Defragmentation sessions by trigger."""
    defrag_pages_moved_total: int
    defrag_active: bool
    """An automatic session is under way (it advances between engine steps)."""
    last_defrag: DefragResult | None
    last_defrag_age_seconds: float | None
    auto_defrag_enabled: bool
    resizes_total: dict[str, int]
    """Resizes by direction (grow, shrink)."""
    requests_running: int
    requests_waiting: int
    preemptions_total: int
    """Running requests whose pages were taken back (recomputed later)."""
    page_groups: int = 1
    """Page tables per request: 1, or, for a model whose sliding-window layers keep pages of
    their own (`--window-pages release`), one per layer group, each page holding the K/V of its
    group's layers (`bytes_per_page`)."""
    window_pages: int = 0
    """Pages the running requests' sliding-window groups hold (part of `used_pages`): at most
    their window's and the next token's, the rest given back."""
    window_released_pages_total: int = 0
    """Pages sliding windows gave back while their requests ran: free (or cached) at once."""
    prefix_pins: int = 0
    """Prefixes pinned on the device (`kvctl prefix pin`)."""
    prefix_pinned_pages: int = 0
    """Pages the pins hold (part of `used_pages`: never evicted while pinned)."""
    prefix_pin_cap_pages: int = 0
    """The most pages pins may hold (`prefix_cache.max_pinned_share` of the pool)."""
    token_slots_used: int | None = None
    """Token slots of the used pages that hold a token's K/V (a partly filled last page, and
    pages taken ahead of the tokens, hold fewer than their page size); null from an agent that
    does not count them."""
    preemptions_by_reason_total: dict[str, int] = {}
    """Preemptions by reason: `growth` (a running request needed a page), `pool_too_small`
    (alone, waiting for the pool to grow), `shrink` (the pool gave memory back)."""
    prefix_evictions_by_reason_total: dict[str, int] = {}
    """Prefix pages evicted, by what needed the room: `allocation`, `shrink`, `clear`."""
    prefix_residency: dict[str, DurationBuckets] = {}
    """The prefix cache's residency histograms (`lifetime`, `idle_before_eviction`,
    `reuse_gap`), as `/metrics` serves them; empty without a prefix cache."""
    alert_notifications_dropped_total: int = 0
    """Alertmanager notifications given up after their retries."""
    gpus: list[GpuMemory]
    """What NVML reports; empty on a host without a GPU."""
    max_waiting: int = 0
    """The queue's cap: a request arriving when it is full is refused with 429."""
    oldest_waiting_seconds: float = 0.0
    """How long the oldest waiting request has waited; 0 when none waits."""
    queue_stalled_seconds: float = 0.0
    """How long requests have waited while no token was produced and none admitted."""
    window_alloc_attempts: int = 0
    """Allocations attempted within the window (the success ratio's denominator)."""
    window_alloc_failures: int = 0
    requests_finished_total: dict[str, int] = {}
    """Requests ended, by finish reason."""
    requests_rejected_total: dict[str, int] = {}
    """Requests refused before they ran, by reason."""
    admin_actions_total: dict[str, int] = {}
    """Mutating API calls carried out, by action."""
    share: PoolShare | None = None
    """Where the pool stands in the budget it shares with the agent's other pools; null when
    the agent serves one model (its `--kv-budget` is then its ceiling, `max_pool_pages`)."""
    sleep: SleepReading = SleepReading()
    """Whether the model sleeps (kvctl sleep; sleep.idle_s): asleep, its pool holds no pages
    and its capacity reads 0."""

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def token_usage_ratio(self) -> float | None:
        """Token slots holding K/V ÷ the pool's token slots: usage counted in tokens, beside
        `pressure_ratio` counted in pages (docs/metrics.md, "Token usage and page usage")."""
        slots = self.capacity_pages * self.page_size
        if self.token_slots_used is None or not slots:
            return None
        return self.token_slots_used / slots


class DurationBuckets(Response):
    """A histogram: `cumulative[i]` observations at or below `bounds[i]` seconds, the last entry
    all of them (+Inf), and their sum."""

    bounds: list[float]
    cumulative: list[int]
    sum: float


class PoolList(Response):
    """GET /v1/pools: every pool of the agent, one per served model, in the order they were
    configured; `budget_bytes` is the budget they share (null without one)."""

    pools: list[PoolSnapshot]
    budget_bytes: int | None = None
    assigned_bytes: int | None = None


PageStateName = Literal["free", "used", "cached", "window"]
"""`window`: used, by a sliding-window layer group (pages such a group gives back as its window
moves on)."""


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
    """Exactly one of `pages` or `bytes`. The device pool (`tier` "device", the default) is
    rounded up to whole segments and must keep at least one; a host or disk tier takes whole
    pages of its own and may be 0 (off until resized again)."""

    tier: Literal["device", "host", "disk"] = "device"
    pages: Annotated[int, Field(ge=0, le=1 << 40)] | None = None
    bytes: Annotated[int, Field(ge=0, le=1 << 60)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ResizeRequest:
        if (self.pages is None) == (self.bytes is None):
            raise ValueError("give exactly one of `pages` or `bytes`")
        if self.tier == "device" and not (self.pages or self.bytes):
            raise ValueError("the device pool needs at least one page")
        return self


ResizeDirection = Literal["grow", "shrink", "none"]


class ResizeResult(Response):
    old_pages: int
    new_pages: int
    old_bytes: int
    new_bytes: int
    direction: ResizeDirection
    pages_moved: int
    pages_evicted: int
    tier: Literal["device", "host", "disk"] = "device"
    pool: str | None = None
    """The pool resized (the model's name)."""
    pinned: bool = False
    """The pool shares a budget and this resize pinned it: the agent moves no memory in or out
    of it until it is released (`POST /v1/pools/{name}/release`)."""


class PoolRelease(Response):
    """POST /v1/pools/{name}/release: the pool is the agent's to resize again."""

    pool: str
    was_pinned: bool


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
    rebalance: dict[str, object] | None = None
    chat: dict[str, object] | None = None


# ---- completions (OpenAI-compatible) --------------------------------------------------------


TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(Strict):
    include_usage: bool = False
    """A last chunk with `choices: []` and the whole request's usage, before `[DONE]`."""


UNSUPPORTED = "unsupported_field"
"""The validation error type of a field the agent knows and does not implement: a 400 naming
it (kvctl.agent.http.server), where an unknown field is a 422."""
ANY = object()
"""In `VLLM_UNSUPPORTED`: every value is accepted, as vLLM ignores the field on these routes."""

VLLM_UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported by this agent"),
    "length_penalty": ((1.0,), "it only applies to beam search, which this agent does not do"),
    "early_stopping": ((False,), "it only applies to beam search, which this agent does not do"),
    "prompt_logprobs": ((), "this agent does not compute the prompt's log-probabilities"),
    "logprob_token_ids": ((), "log-probabilities of chosen ids are not supported; use logprobs"),
    "bad_words": (([],), "not supported; logit_bias -100 bans a single token"),
    "truncate_prompt_tokens": (
        (),
        "prompt truncation is not supported: a prompt over the limit is refused (400) instead",
    ),
    "truncation_side": (("left", "right"), "must be left or right"),
    "structured_outputs": ((), "structured output (constrained decoding) is not supported"),
    "guided_json": ((), "guided (constrained) decoding is not supported"),
    "guided_regex": ((), "guided (constrained) decoding is not supported"),
    "guided_choice": ((), "guided (constrained) decoding is not supported"),
    "guided_grammar": ((), "guided (constrained) decoding is not supported"),
    "guided_decoding_backend": ((), "guided (constrained) decoding is not supported"),
    "guided_whitespace_pattern": ((), "guided (constrained) decoding is not supported"),
    "watermarking": ((False,), "watermarking is not supported"),
    "priority": ((0,), "priority scheduling is not supported: requests are served in order"),
    "kv_transfer_params": ((), "disaggregated serving (KV transfer) is not supported"),
    "ec_transfer_params": ((), "disaggregated serving (encoder cache transfer) is not supported"),
    "vllm_xargs": (({},), "vLLM extension arguments are not supported"),
    "repetition_detection": ((), "repetition detection is not supported"),
    "thinking_token_budget": ((-1,), "thinking budgets are not supported"),
    "stream_interval": ((1,), "every token is streamed as its own chunk; stream_interval 1 only"),
    "session_id": ((ANY,), ""),
    "routed_experts_prompt_start": ((ANY,), ""),
    "return_token_offsets": ((ANY,), ""),
    "mm_payload": ((ANY,), ""),
    "return_mm_kwargs": ((ANY,), ""),
}
"""vLLM's extensions of both endpoints that the agent does not implement (vLLM's own request
models, entrypoints/openai/*/protocol.py): the values accepted besides null, and why another
is refused. `ANY`: accepted whatever the value, because vLLM ignores the field on these routes
(render-endpoint fields, session routing)."""


def _neutral(value: object, accepted: tuple[object, ...]) -> bool:
    """Whether a raw JSON value is one of `accepted` (null always is; 1 and 1.0 alike, true
    never 1)."""
    if value is None or ANY in accepted:
        return True
    for neutral in accepted:
        if isinstance(value, bool) or isinstance(neutral, bool):
            if value is neutral:
                return True
        elif isinstance(value, int | float) and isinstance(neutral, int | float):
            if value == neutral:
                return True
        elif type(value) is type(neutral) and value == neutral:
            return True
    return False


class SamplingFields(Strict):
    """How one request's tokens are chosen and its text shaped: each field's type on the wire,
    its bounds, its default and its meaning, written once. The request bodies inherit them
    (`GenerationFields`), the engine runs them as `SamplingParams` (kvctl.agent.model.sampling,
    this class plus `max_tokens` and `logprobs`), and docs/api.md is generated from them: a new
    sampling field is a field here and the code that honours it."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    """Below 1e-5: greedy (vLLM's threshold)."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=1 << 20)] = 0
    """0 or -1: no limit."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    """Keep the tokens whose probability (after temperature) is at least min_p times the top
    token's."""
    typical_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Locally typical sampling (transformers', TGI's and llama.cpp's `typical_p`), after top-p:
    keep the tokens whose surprise is closest to the distribution's entropy until they hold this
    much of the probability (1: off)."""
    seed: Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)] | None = None
    """Any 64-bit integer, signed or unsigned: the request's own random stream, so the same
    tokens on every run whatever shares its batch."""
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or the stop token's text) at the end of the output."""
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    """Over the prompt's and the output's tokens, a logit > 0 is divided by it, one < 0
    multiplied (1: none)."""
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                Annotated[float, Field(ge=-100.0, le=100.0)],
            ],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    allowed_token_ids: (
        Annotated[Sequence[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None
    ) = None
    """Only these tokens can be chosen."""
    stop_token_ids: Annotated[Sequence[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_COMPLETION_TOKENS)] = 0
    skip_special_tokens: bool = True
    """False: special tokens' text is part of the output."""
    spaces_between_special_tokens: bool = True
    """Accepted both ways: tokenizer.json decoding has no such option (transformers' fast
    tokenizers ignore it too), so the text is the same."""
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


MaxTokens = Annotated[int, Field(ge=1, le=MAX_COMPLETION_TOKENS)]
"""`max_tokens` (and chat's `max_completion_tokens`) wherever a request gives it."""


class GenerationFields(SamplingFields):
    """The fields completions and chat share (docs/operations.md): the sampling fields, and the
    request's model, choices, streaming and answer options, with vLLM's extensions: those the
    agent implements are fields, those it does not (`VLLM_UNSUPPORTED`) are accepted at a
    neutral value and refused with a 400 naming them otherwise."""

    unsupported: ClassVar[dict[str, tuple[tuple[object, ...], str]]] = VLLM_UNSUPPORTED

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    user: str | None = None  # accepted and ignored: the agent keeps no per-user state
    request_id: Annotated[str, Field(max_length=256)] | None = None
    """Accepted and ignored (vLLM's tracing id): answers carry the agent's own ids."""
    cache_salt: Annotated[str, Field(max_length=256)] | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None
    """With logprobs, each token as `token_id:N` instead of its text."""
    response_format: dict[str, object] | None = None
    """Only `{"type": "text"}`: structured output is not supported."""

    @model_validator(mode="before")
    @classmethod
    def _unsupported_vllm_fields(cls, data: object) -> object:
        """Drop the unsupported vLLM fields given a neutral value; refuse one given another."""
        if not isinstance(data, dict) or not cls.unsupported.keys() & data.keys():
            return data
        kept = dict(data)
        for name, (accepted, reason) in cls.unsupported.items():
            if name in kept and not _neutral(kept.pop(name), accepted):
                raise PydanticCustomError(UNSUPPORTED, f"{name}: {reason}")
        return kept


class CompletionRequest(GenerationFields):
    """POST /v1/completions, OpenAI's fields plus vLLM's sampling and output extensions (those it
    does not implement are accepted at a neutral value, else a 400 naming them:
    docs/operations.md). `prompt` is one prompt (text or token ids) or a list of them; each gets
    `n` choices, numbered prompt by prompt. A text prompt is the client's whole input, tokenized
    as given: special-token text in it is read as the special token (docs/security.md)."""

    unsupported: ClassVar[dict[str, tuple[tuple[object, ...], str]]] = {
        **VLLM_UNSUPPORTED,
        "prompt_embeds": ((), "prompt embeddings are not supported; send text or token ids"),
    }

    prompt: (
        str
        | list[TokenId]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: MaxTokens = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0)] | None = None  # 0..5, checked by the route (400)
    best_of: Annotated[int, Field(ge=1)] | None = None  # only 1 (or n): refused otherwise
    suffix: str | None = None  # refused when given: no insertion mode
    add_special_tokens: bool = True
    """False: a text prompt is encoded without the BOS the tokenizer adds."""


class ChatContentPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, object]] | None = None  # refused: no tool calling
    tool_call_id: str | None = None  # refused: no tool calling
    reasoning: str | None = None
    """An assistant turn's reasoning (vLLM's field), given back for templates that render it
    (Qwen3's `<think>`, gpt-oss's analysis channel); ignored on other roles, as vLLM does."""
    reasoning_content: str | None = None
    """The older name of `reasoning`."""


MAX_TEMPLATE_KWARGS = 16
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
TEMPLATE_OWN_NAMES = (
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "tools",
    "documents",
)
TemplateName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
TemplateValue = bool | int | float | Annotated[str, StringConstraints(max_length=4096)] | None


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions: OpenAI's chat fields and vLLM's extensions, rendered with the
    model's chat template. Tool calling, structured output and the vLLM extensions it does not
    implement (at other than a neutral value) are refused with 400 naming the field.
    Special-token text inside a message (`<|im_end|>`) is tokenized as plain text, so only the
    template writes control tokens, unless `chat.special_tokens_in_content` is `raw`
    (docs/security.md)."""

    unsupported: ClassVar[dict[str, tuple[tuple[object, ...], str]]] = {
        **VLLM_UNSUPPORTED,
        "echo": ((False,), "prepending the last message to the reply is not supported"),
        "continue_final_message": ((False,), "continuing the final message is not supported"),
        "chat_template": ((), "the checkpoint's chat template is used; it cannot be replaced"),
        "documents": (([],), "documents (retrieval templates) are not supported"),
        "mm_processor_kwargs": (({},), "multimodal input is not supported"),
        "media_io_kwargs": (({},), "multimodal input is not supported"),
        "include_reasoning": ((ANY,), ""),
        "return_prompt_text": ((False,), "the rendered prompt's text is not returned"),
    }

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None  # 0..20, checked by the route (400)
    add_generation_prompt: bool = True
    """False: the template renders the conversation without the assistant's opening."""
    add_special_tokens: bool = False
    """True: the tokenizer adds its specials (BOS) on top of what the template writes."""
    chat_template_kwargs: (
        Annotated[
            dict[TemplateName, TemplateValue],
            Field(max_length=MAX_TEMPLATE_KWARGS),
        ]
        | None
    ) = None
    """More variables for the chat template, as transformers' `apply_chat_template` takes them
    (Qwen3's `enable_thinking`): names of letters, digits and `_`, values true/false, numbers,
    null or strings; the template's own variables (`messages`, `add_generation_prompt`, the
    special tokens, `tools` and `documents`) cannot be replaced."""
    reasoning_effort: ReasoningEffort | None = None
    """For reasoning models, as vLLM passes it: the template variable `reasoning_effort`
    (gpt-oss's), and `enable_thinking` false for "none", true otherwise, unless
    chat_template_kwargs sets it (Qwen3's)."""
    tools: list[object] | None = None
    tool_choice: object | None = None
    parallel_tool_calls: bool | None = None
    functions: list[object] | None = None
    function_call: object | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_templates_own(
        cls, value: dict[str, TemplateValue] | None
    ) -> dict[str, TemplateValue] | None:
        taken = sorted(set(value or ()) & set(TEMPLATE_OWN_NAMES))
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be replaced: the agent sets it")
        return value


RejectReason = Literal["queue_full", "too_large", "invalid", "shutting_down", "wake_failed"]
"""Why a request was refused before it was queued (`requests_rejected_total`): `queue_full`,
429, the queue is at --max-waiting; `too_large`, its prompt plus max_tokens can never fit the pool
or the model's context; `invalid`, a limit on the input (prompt bytes or tokens, `max_tokens`);
`shutting_down`, 503 while the agent drains; `wake_failed`, 503, its model sleeps and could not
wake (no room for its pool)."""

AdminAction = Literal[
    "defrag",
    "resize",
    "release",
    "config",
    "alert_test",
    "prefix_pin",
    "prefix_unpin",
    "prefix_clear",
    "prefix_move",
    "sleep",
    "wake",
]
"""The audited mutations (`admin_actions_total`)."""

FinishReasonName = Literal["stop", "length", "abort", "capacity"]
"""`stop`: EOS or a stop string; `length`: max_tokens or the model's context was reached (never
anything else); `abort`: the client went away or the agent shut down; `capacity`: the request
lost its pages and the pool can no longer hold it (the agent's resize and admission rules keep
this from happening; it is reported, never silent, if it does)."""


class CompletionLogprobs(Response):
    """OpenAI's legacy completions shape: one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Response):
    index: int = 0
    text: str
    finish_reason: FinishReasonName | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
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


class ChatTopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = []


class ChatLogprobs(Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(Response):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: FinishReasonName | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None
    finish_detail: str | None = None


class ChatCompletionResponse(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # the rendered conversation, with return_token_ids


# ---- tokenize -------------------------------------------------------------------------------

MAX_TOKENIZE_TEXTS = 256
"""Texts one /v1/tokenize call may carry (the body limit bounds their size)."""


class TokenizeRequest(Strict):
    """POST /v1/tokenize: texts to count in the served model's tokens (vLLM has `/tokenize`).

    `prompt` is one text or a batch, so a client sizing many prompts pays one round trip."""

    model: str | None = None
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_TOKENIZE_TEXTS)]
    return_token_ids: bool = True
    add_special_tokens: bool = True
    """False: the text alone, without the BOS a prompt gets (to count a piece of a prompt)."""


class TokenizedText(Response):
    count: int
    """Tokens the prompt is, as /v1/completions counts it (`usage.prompt_tokens`)."""
    tokens: list[int] | None = None


class TokenizeResponse(Response):
    model: str
    max_model_len: int
    """The model's context: prompt plus max_tokens of one request."""
    results: list[TokenizedText]
    """One per text, in the order given."""


# ---- prefix operations ----------------------------------------------------------------------

PrefixPlace = Literal["all", "device", "host", "disk"]
MAX_PREFIX_TOKEN_IDS = 1 << 20
MAX_PREFIX_TTL_S = 366 * 86400.0


class PrefixQuery(Strict):
    """A prompt to look up or pin, in one of three forms: text (`prompt`, tokenized as a
    completion's prompt is), a chat (`messages`, rendered with the model's template without the
    generation prompt: a system prompt as a conversation starts with it) or `token_ids`; and the
    partition it is in (`cache_salt`) on `model` (optional when the agent serves one)."""

    model: Annotated[str, Field(max_length=256)] | None = None
    prompt: Annotated[str, Field(min_length=1, max_length=4 * MAX_PREFIX_TOKEN_IDS)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = (
        None
    )
    token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PREFIX_TOKEN_IDS)] | None
    ) = None
    cache_salt: Annotated[str, Field(max_length=256)] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> PrefixQuery:
        given = [f for f in ("prompt", "messages", "token_ids") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of `prompt`, `messages` or `token_ids`")
        return self


class PrefixPinRequest(PrefixQuery):
    """POST /v1/prefix/pins: pin what the device holds of the prompt, for `ttl_s` seconds
    (none: until unpinned)."""

    ttl_s: Annotated[float, Field(gt=0, le=MAX_PREFIX_TTL_S)] | None = None
    warm: bool = False
    """Compute the prompt first when the device does not hold all of its whole pages (a
    one-token request in the same partition, queued like any other), then pin."""


class PrefixMoveRequest(PrefixQuery):
    """POST /v1/prefix/move: bring the prompt's prefix to the device (computed, or loaded from a
    tier that holds it, as a one-token request would) before a known burst, or store a copy of
    the device's pages in the host tier (`to` "host")."""

    to: Literal["device", "host", "disk"]


class PrefixLookupResult(Response):
    """How much of a prompt an agent holds, in whole pages of its partition."""

    model: str
    cache_salt: str | None
    prompt_tokens: int
    device_tokens: int
    """Tokens of the prompt's start on the device (what the next request reuses, less its last
    token, which is always computed)."""
    device_pages: int
    tier_tokens: dict[str, int]
    """Tokens of the prompt's start each tier below the device holds (host, disk)."""
    last_used_at: float | None
    """When the device's prefix was last used or stored (Unix seconds, to a second)."""
    pins: list[str]
    """The pins holding any of its pages."""


class PrefixPinView(Response):
    id: str
    model: str
    cache_salt: str | None
    tokens: int
    pages: int
    created_at: float
    expires_at: float | None
    preview: str
    """The prefix's first tokens as text."""


class CachedPrefixView(Response):
    model: str
    cache_salt: str | None
    tokens: int
    pages: int
    last_used_at: float | None
    preview: str


class PrefixListing(Response):
    """GET /v1/prefix: the pins and the largest cached prefixes of every pool (or one)."""

    pins: list[PrefixPinView]
    prefixes: list[CachedPrefixView]
    pinned_pages: int
    pin_cap_pages: int
    capacity_pages: int


class PrefixClearRequest(Strict):
    """POST /v1/prefix/clear: forget cached prefixes (and their pins) of one model or every
    model, one cache salt or every salt, in one place or all."""

    model: Annotated[str, Field(max_length=256)] | None = None
    cache_salt: Annotated[str, Field(max_length=256)] | None = None
    tier: PrefixPlace = "all"


class PrefixClearResult(Response):
    models: list[str]
    pages_freed: dict[str, int]
    """Pages let go, per place (device, host, disk)."""
    pins_removed: list[str]
    pages_in_use: int
    """Pages of the cleared partitions that running requests still use: they stay until those
    requests end, and are cached again then."""
