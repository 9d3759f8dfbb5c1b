"""Cause analysis: for each alert, the likely causes in the order an engineer would check them.

Each list is tried top to bottom and the first cause that applies explains the alert; the last
one always applies. A cause reads only the snapshot (and the reading and thresholds), so each is
a pure function tested on a hand-made snapshot, and its remedy names the exact `kvctl` command
or runtime setting, with a value to try.
"""

from __future__ import annotations

from kvctl.alerts import text
from kvctl.alerts.definition import Cause, Situation, always
from kvctl.api import GpuMemory

RESIZE_HIGH_WATER = 0.85
"""`resize.high_water` to suggest: grow before the pool is full, not when it is."""
DEFRAG_STEP_PAGES = 256
"""`defrag.step_max_pages` to suggest when runs stop before finishing (the default is 64)."""
DEFRAG_CHECK_INTERVAL_S = 2
"""`defrag.check_interval_s` to suggest when fragmentation regrows between checks."""
GPU_MEMORY_FRACTION = 0.8
"""`--gpu-memory-fraction` to suggest when the device is nearly full."""


def lower_fragmentation_threshold(fragmentation_max: float) -> float:
    """A `defrag.fragmentation_threshold` that lets auto-defrag act before the alert fires."""
    return round(max(0.1, fragmentation_max - 0.2), 2)


# ---- shared pieces --------------------------------------------------------------------------


def _at_limit(sit: Situation) -> bool:
    s = sit.snapshot
    return s.max_pool_pages is not None and s.capacity_pages >= s.max_pool_pages


def _raise_limit(sit: Situation) -> str:
    return (
        f"Restart the agent with `--max-pool-pages {text.raised_limit(sit.snapshot)}` if the "
        "device has the memory; otherwise send fewer concurrent or shorter requests"
    )


def _grow(sit: Situation) -> str:
    target = text.grow_target(sit.snapshot)
    if target is None:
        return _raise_limit(sit)
    auto = text.patch(
        text.setting("resize.enabled", True), text.setting("resize.high_water", RESIZE_HIGH_WATER)
    )
    return (
        f"Run {text.command(sit.agent_url, f'pool resize --pages {target}')}; "
        f"to grow on demand, {auto}"
    )


def _defrag_now(sit: Situation) -> str:
    return text.command(sit.agent_url, "defrag --now")


def _lower_threshold(sit: Situation) -> str:
    return text.setting(
        "defrag.fragmentation_threshold",
        lower_fragmentation_threshold(sit.settings.fragmentation_max),
    )


def _sooner(sit: Situation) -> str:
    interval = text.setting("defrag.check_interval_s", DEFRAG_CHECK_INTERVAL_S)
    return text.patch(_lower_threshold(sit), interval)


def _defrag_active(sit: Situation) -> bool:
    return sit.snapshot.defrag_active


def _last_incomplete(sit: Situation) -> bool:
    last = sit.snapshot.last_defrag
    return last is not None and not last.complete


def _last_lowered_it(sit: Situation) -> bool:
    last = sit.snapshot.last_defrag
    return last is not None and last.fragmentation_after <= sit.settings.fragmentation_max


def _last_moved_nothing(sit: Situation) -> bool:
    last = sit.snapshot.last_defrag
    return last is not None and last.pages_moved == 0


def _last(sit: Situation) -> str:
    return text.last_defrag(sit.snapshot)


def _shrink_pool(sit: Situation) -> str:
    pages = text.shrink_target(sit.snapshot)
    return text.command(sit.agent_url, f"pool resize --pages {pages}")


def _trim_pool(sit: Situation) -> str:
    pages = text.trim_target(sit.snapshot)
    return text.command(sit.agent_url, f"pool resize --pages {pages}")


def _before_after(sit: Situation) -> str:
    last = sit.snapshot.last_defrag
    assert last is not None
    return f"{text.ratio(last.fragmentation_before)} → {text.ratio(last.fragmentation_after)}"


def _in_use(sit: Situation) -> int:
    return sit.snapshot.used_pages + sit.snapshot.cached_pages


# ---- allocation failures --------------------------------------------------------------------

ALLOCATION_FAILURES = (
    Cause(
        _at_limit,
        lambda sit: (
            f"the pool is at its limit of {sit.snapshot.max_pool_pages} pages "
            f"({sit.snapshot.free_pages} free, {sit.snapshot.cached_pages} cached) and may not grow"
        ),
        _raise_limit,
    ),
    Cause(
        lambda sit: sit.snapshot.requests_waiting > 0,
        lambda sit: (
            f"{sit.snapshot.requests_waiting} requests wait while the pool is "
            f"{text.percent(sit.snapshot.utilization_ratio)} full: demand outgrows its "
            f"{sit.snapshot.capacity_pages} pages"
        ),
        _grow,
    ),
    Cause(
        always,
        lambda sit: (
            f"the pool ({sit.snapshot.capacity_pages} pages, "
            f"{text.percent(sit.snapshot.utilization_ratio)} in use) ran out of free and "
            "evictable pages in a burst"
        ),
        _grow,
    ),
)

# ---- fragmentation --------------------------------------------------------------------------

FRAGMENTATION_HIGH = (
    Cause(
        _defrag_active,
        lambda sit: f"a defrag is running now; {_last(sit)}",
        lambda sit: (
            "Let the running defrag finish and check with "
            f"{text.command(sit.agent_url, 'pool show')}; if it recurs, "
            f"{text.patch(text.setting('defrag.step_max_pages', DEFRAG_STEP_PAGES))}"
        ),
    ),
    Cause(
        lambda sit: not sit.snapshot.auto_defrag_enabled,
        lambda sit: f"{_last(sit)}; auto-defrag is off",
        lambda sit: (
            f"Run {_defrag_now(sit)}, then "
            f"{text.patch(text.setting('defrag.enabled', True))} to keep it low"
        ),
    ),
    Cause(
        _last_incomplete,
        lambda sit: f"{_last(sit)} and stopped before finishing ({_before_after(sit)})",
        lambda sit: (
            f"Run {_defrag_now(sit)} for a full pass; so runs finish, "
            f"{text.patch(text.setting('defrag.step_max_pages', DEFRAG_STEP_PAGES))}"
        ),
    ),
    Cause(
        _last_lowered_it,
        lambda sit: (
            f"{_last(sit)} ({_before_after(sit)}), but requests ending at "
            "different times have scattered the free pages again"
        ),
        lambda sit: f"Run {_defrag_now(sit)}; to let auto-defrag act sooner, {_sooner(sit)}",
    ),
    Cause(
        lambda sit: sit.snapshot.last_defrag is None,
        lambda sit: (
            "no defrag has run since the agent started although auto-defrag is on: "
            "`defrag.fragmentation_threshold` is above "
            f"{text.ratio(sit.snapshot.fragmentation_ratio)} or fewer than "
            "`defrag.min_free_pages` pages are free"
        ),
        lambda sit: f"Run {_defrag_now(sit)}; {text.patch(_lower_threshold(sit))}",
    ),
    Cause(
        always,
        lambda sit: f"{_last(sit)} and left it at {_before_after(sit)}",
        lambda sit: (
            f"Run {_defrag_now(sit)} and compare fragmentation before and after in its output; "
            f"{text.patch(text.setting('defrag.fragmentation_target', 0.05))}"
        ),
    ),
)

DEFRAG_INEFFECTIVE = (
    Cause(
        _defrag_active,
        lambda sit: f"a defrag is running now and has not finished; {_last(sit)}",
        lambda sit: (
            "Let it finish; if runs keep taking this long, "
            f"{text.patch(text.setting('defrag.step_max_pages', DEFRAG_STEP_PAGES))}"
        ),
    ),
    Cause(
        _last_moved_nothing,
        lambda sit: (
            f"{_last(sit)}: it found no page to move, so the "
            f"{sit.snapshot.free_extents} free extents stayed"
        ),
        lambda sit: (
            f"Run {_defrag_now(sit)} and read `pages_moved` in its output; if it is 0 again, "
            f"save {text.command(sit.agent_url, 'pool map --json')} for a bug report"
        ),
    ),
    Cause(
        _last_incomplete,
        lambda sit: f"{_last(sit)} but stopped before finishing ({_before_after(sit)})",
        lambda sit: (
            f"Run {_defrag_now(sit)} for a full pass; so runs finish, "
            f"{text.patch(text.setting('defrag.step_max_pages', DEFRAG_STEP_PAGES))}"
        ),
    ),
    Cause(
        _last_lowered_it,
        lambda sit: (
            f"{_last(sit)} ({_before_after(sit)}), but requests ending at "
            "different times scatter free pages faster than defrag runs"
        ),
        lambda sit: f"Let auto-defrag run sooner and more often: {_sooner(sit)}",
    ),
    Cause(
        always,
        lambda sit: f"{_last(sit)} and finished at {_before_after(sit)}",
        lambda sit: (
            f"Run {_defrag_now(sit)} and compare fragmentation before and after in its output; "
            f"{text.patch(text.setting('defrag.fragmentation_target', 0.05))}"
        ),
    ),
)

# ---- pool size ------------------------------------------------------------------------------

POOL_NEARLY_FULL = (
    Cause(
        lambda sit: 2 * sit.snapshot.cached_pages >= _in_use(sit) > 0,
        lambda sit: (
            f"{sit.snapshot.cached_pages} of the {_in_use(sit)} pages in use hold only "
            "prefix-cache entries, which are evicted on demand"
        ),
        lambda sit: f"No action needed while allocations succeed; for more headroom: {_grow(sit)}",
    ),
    Cause(
        _at_limit,
        lambda sit: (
            f"the pool is at its limit of {sit.snapshot.max_pool_pages} pages with "
            f"{sit.snapshot.requests_waiting} requests waiting"
        ),
        _raise_limit,
    ),
    Cause(
        always,
        lambda sit: (
            f"{sit.snapshot.used_pages} pages held by {sit.snapshot.requests_running} running "
            f"requests, {sit.snapshot.requests_waiting} waiting"
        ),
        _grow,
    ),
)

POOL_OVER_PROVISIONED = (
    Cause(
        lambda sit: sit.snapshot.capacity_pages <= sit.snapshot.segment_pages,
        lambda sit: (
            f"the pool is a single segment of {sit.snapshot.segment_pages} pages and cannot shrink"
        ),
        lambda sit: (
            "Nothing to shrink at run time; if the memory is needed elsewhere, restart the agent "
            f"with `--pool-pages {text.shrink_target(sit.snapshot)}` and a smaller "
            "`--segment-pages`"
        ),
    ),
    Cause(
        always,
        lambda sit: (
            f"{_in_use(sit)} of {sit.snapshot.capacity_pages} pages in use with "
            f"{sit.snapshot.requests_running} requests running"
        ),
        lambda sit: (
            f"Run {_shrink_pool(sit)}; to shrink automatically, "
            f"{text.patch(text.setting('resize.enabled', True))}"
        ),
    ),
)

# ---- prefix cache and scheduler -------------------------------------------------------------

PREFIX_HIT_RATE_LOW = (
    Cause(
        lambda sit: (
            sit.snapshot.utilization_ratio >= RESIZE_HIGH_WATER
            and sit.snapshot.prefix_evictions_total > 0
        ),
        lambda sit: (
            f"the pool is {text.percent(sit.snapshot.utilization_ratio)} full and the cache has "
            f"evicted {sit.snapshot.prefix_evictions_total} entries since start: prefixes are "
            "pushed out before they are reused"
        ),
        lambda sit: (
            "Keep often reused prefixes: "
            f"{text.patch(text.setting('prefix_cache.eviction_policy', 'lfu'))}; or give the "
            f"cache room: {_grow(sit)}"
        ),
    ),
    Cause(
        always,
        lambda sit: (
            f"{sit.snapshot.prefix_hits_tokens_total} of "
            f"{sit.snapshot.prefix_queries_tokens_total} prompt tokens looked up since start were "
            "found: requests share few prefixes, or clients send different `cache_salt` values"
        ),
        lambda sit: (
            "Make shared prompt prefixes (system prompt, examples) byte-identical and keep one "
            "`cache_salt` per tenant; if requests never share prefixes, restart the agent with "
            "`--no-prefix-cache` to skip the lookups"
        ),
    ),
)

PREEMPTION_STORM = (
    Cause(
        _at_limit,
        lambda sit: f"the pool is at its limit of {sit.snapshot.max_pool_pages} pages",
        _raise_limit,
    ),
    Cause(
        always,
        lambda sit: (
            f"the {sit.snapshot.requests_running} running requests outgrow the pool's "
            f"{sit.snapshot.capacity_pages} pages, so the youngest is preempted and recomputed"
        ),
        _grow,
    ),
)

# ---- GPU memory -----------------------------------------------------------------------------


def _gpu(sit: Situation) -> GpuMemory:
    index = int(sit.labels["gpu"])
    return next(g for g in sit.snapshot.gpus if g.index == index)


def _split_heavy(sit: Situation) -> bool:
    gpu = _gpu(sit)
    return (gpu.torch_inactive_split_bytes or 0) >= 0.1 * gpu.total_bytes


GPU_MEMORY_NEAR_CAPACITY = (
    Cause(
        _split_heavy,
        lambda sit: (
            "torch's caching allocator holds "
            f"{text.size(_gpu(sit).torch_inactive_split_bytes or 0)} in split blocks it cannot "
            "reuse"
        ),
        lambda sit: (
            "Restart the agent with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in its "
            f"environment; meanwhile give back spare pages with {_trim_pool(sit)}"
        ),
    ),
    Cause(
        lambda sit: sit.snapshot.utilization_ratio < 0.5,
        lambda sit: (
            f"the KV pool holds {text.size(sit.snapshot.capacity_bytes)} of the GPU's "
            f"{text.size(_gpu(sit).total_bytes)} but only "
            f"{text.percent(sit.snapshot.utilization_ratio)} of it is in use"
        ),
        lambda sit: f"Give memory back with {_shrink_pool(sit)}",
    ),
    Cause(
        always,
        lambda sit: (
            f"the KV pool holds {text.size(sit.snapshot.capacity_bytes)} "
            f"({text.percent(sit.snapshot.utilization_ratio)} in use); the model, activations "
            "and other processes hold "
            f"{text.size(max(0, _gpu(sit).used_bytes - sit.snapshot.capacity_bytes))}"
        ),
        lambda sit: (
            f"Restart the agent with `--gpu-memory-fraction {GPU_MEMORY_FRACTION}`, and check "
            f"`nvidia-smi` for other processes on GPU {_gpu(sit).index}"
        ),
    ),
)
