"""Cause analysis: for each alert, the likely causes in the order an engineer would check them.

Each list is tried top to bottom and the first cause that applies explains the alert; the last
one always applies. A cause reads only the snapshot, the reading and the runtime settings in
force, so each is a pure function tested on a hand-made snapshot. Its remedy, built from
`remedies`, names the exact `kvctl` command or runtime setting with a value to try.
"""

from __future__ import annotations

from kvctl.alerts import text
from kvctl.alerts.definition import Cause, Situation, TierWindow, always
from kvctl.alerts.remedies import (
    GPU_MEMORY_FRACTION,
    RESIZE_HIGH_WATER,
    auto_shrink,
    defrag_now,
    disk_tier_fit,
    grow,
    keep_evidence,
    keep_reused,
    larger_budget,
    longer_steps,
    move_model,
    raise_limit,
    release_pool,
    resize_tier,
    shrink_pool,
    skip_short_hits,
    sooner,
    tier_off,
    trim_pool,
    unblock,
)
from kvctl.api import GpuMemory, PoolShare, TierReading

# ---- shared pieces --------------------------------------------------------------------------


def _at_limit(sit: Situation) -> bool:
    s = sit.snapshot
    return s.max_pool_pages is not None and s.capacity_pages >= s.max_pool_pages


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


def _before_after(sit: Situation) -> str:
    last = sit.snapshot.last_defrag
    assert last is not None
    return f"{text.ratio(last.fragmentation_before)} → {text.ratio(last.fragmentation_after)}"


def _in_use(sit: Situation) -> int:
    return sit.snapshot.used_pages + sit.snapshot.cached_pages


def _held(sit: Situation) -> str:
    """How much of the pool running requests hold: "running requests hold 97% of the pool"."""
    return f"running requests hold {text.percent(sit.snapshot.pressure_ratio)} of the pool"


# ---- allocation failures --------------------------------------------------------------------

ALLOCATION_FAILURES = (
    Cause(
        _at_limit,
        lambda sit: (
            f"the pool is at its limit of {sit.snapshot.max_pool_pages} pages "
            f"({sit.snapshot.free_pages} free, {sit.snapshot.cached_pages} cached) and may not grow"
        ),
        raise_limit,
    ),
    Cause(
        lambda sit: sit.snapshot.requests_waiting > 0,
        lambda sit: (
            f"{sit.snapshot.requests_waiting} requests wait while {_held(sit)}: demand outgrows "
            f"its {sit.snapshot.capacity_pages} pages"
        ),
        grow,
    ),
    Cause(
        always,
        lambda sit: (
            f"the pool ({sit.snapshot.capacity_pages} pages, "
            f"{text.percent(sit.snapshot.pressure_ratio)} held by running requests) ran out of "
            "free and evictable pages in a burst"
        ),
        grow,
    ),
)

# ---- the waiting queue ----------------------------------------------------------------------


def _queue_full(sit: Situation) -> bool:
    s = sit.snapshot
    return s.max_waiting > 0 and s.requests_waiting >= s.max_waiting


def _queue_note(sit: Situation) -> str:
    """What a full queue adds to any queue alert: new requests are being turned away."""
    if not _queue_full(sit):
        return ""
    return (
        f"; the queue is full ({sit.snapshot.requests_waiting} of `--max-waiting` "
        f"{sit.snapshot.max_waiting}), so new requests are refused with 429"
    )


QUEUE_STALLED = (
    Cause(
        lambda sit: sit.snapshot.requests_running == 0 and sit.snapshot.cached_pages > 0,
        lambda sit: (
            f"nothing runs while {sit.snapshot.cached_pages} cached prefix pages could be "
            "evicted to admit the head of the queue: the scheduler is not reclaiming the cache"
            f"{_queue_note(sit)}"
        ),
        unblock,
    ),
    Cause(
        lambda sit: sit.snapshot.requests_running == 0 and sit.snapshot.used_pages > 0,
        lambda sit: (
            f"nothing runs, yet {sit.snapshot.used_pages} pages are held as if by running "
            f"requests: pages of finished requests were not released{_queue_note(sit)}"
        ),
        unblock,
    ),
    Cause(
        lambda sit: sit.snapshot.requests_running > 0,
        lambda sit: (
            f"{sit.snapshot.requests_running} requests are running but no step finished: the "
            f"engine is stuck in a step (a hung device or kernel){_queue_note(sit)}"
        ),
        lambda sit: (
            "Check `nvidia-smi` and the agent's log for a hung device or errors; "
            f"{keep_evidence(sit)}"
        ),
    ),
    Cause(
        always,
        lambda sit: (
            f"nothing runs and {sit.snapshot.free_pages} of {sit.snapshot.capacity_pages} pages "
            f"are free: the engine is not admitting requests{_queue_note(sit)}"
        ),
        lambda sit: f"Check the agent's log for errors; {keep_evidence(sit)}",
    ),
)

QUEUE_WAIT_LONG = (
    Cause(
        lambda sit: sit.snapshot.requests_running == 0,
        lambda sit: (
            "nothing runs although requests wait: the queue is stalled "
            f"(KvctlQueueStalled fires after `alerts.queue_stalled_max_s`){_queue_note(sit)}"
        ),
        unblock,
    ),
    Cause(
        _at_limit,
        lambda sit: (
            f"the pool is at its limit of {sit.snapshot.max_pool_pages} pages and {_held(sit)}: "
            f"waiting requests need room the pool may not grow to{_queue_note(sit)}"
        ),
        raise_limit,
    ),
    Cause(
        lambda sit: _queue_full(sit) or sit.snapshot.pressure_ratio >= sit.settings.pressure_high,
        lambda sit: (
            f"{_held(sit)}, so waiting requests are admitted only as running ones finish"
            f"{_queue_note(sit)}"
        ),
        grow,
    ),
    Cause(
        always,
        lambda sit: (
            f"{sit.snapshot.requests_running} requests run and {_held(sit)}: memory is not what "
            "holds the queue, the batch limit or the engine's speed is"
        ),
        lambda sit: (
            "Send part of the traffic to other replicas of the model, or restart the agent with "
            f"a larger `--max-batch-seqs`; {text.command(sit.agent_url, 'status')} shows the queue"
        ),
    ),
)

# ---- fragmentation --------------------------------------------------------------------------

FRAGMENTATION_HIGH = (
    Cause(
        _defrag_active,
        lambda sit: f"a defrag is running now; {_last(sit)}",
        lambda sit: (
            "Let the running defrag finish and check with "
            f"{text.pool_command(sit.agent_url, sit.snapshot, 'pool show')}; if it recurs, "
            f"{longer_steps(sit)}"
        ),
    ),
    Cause(
        lambda sit: not sit.snapshot.auto_defrag_enabled,
        lambda sit: f"{_last(sit)}; auto-defrag is off",
        lambda sit: (
            f"Run {defrag_now(sit)}, then "
            f"{text.patch(text.setting('defrag.enabled', True))} to keep it low"
        ),
    ),
    Cause(
        _last_incomplete,
        lambda sit: f"{_last(sit)} and stopped before finishing ({_before_after(sit)})",
        lambda sit: f"Run {defrag_now(sit)} for a full pass; so runs finish, {longer_steps(sit)}",
    ),
    Cause(
        _last_lowered_it,
        lambda sit: (
            f"{_last(sit)} ({_before_after(sit)}), but requests ending at "
            "different times have scattered the free pages again"
        ),
        lambda sit: f"Run {defrag_now(sit)}; {sooner(sit, 'to let auto-defrag act sooner')}",
    ),
    Cause(
        lambda sit: (
            sit.snapshot.last_defrag is None
            and sit.runtime.defrag.fragmentation_threshold >= sit.snapshot.fragmentation_ratio
        ),
        lambda sit: (
            "no defrag has run since the agent started: auto-defrag starts above "
            f"`defrag.fragmentation_threshold={sit.runtime.defrag.fragmentation_threshold:g}`"
        ),
        lambda sit: f"Run {defrag_now(sit)}; {sooner(sit, 'to let auto-defrag act sooner')}",
    ),
    Cause(
        lambda sit: sit.snapshot.last_defrag is None,
        lambda sit: (
            "no defrag has run since the agent started although fragmentation is above "
            f"`defrag.fragmentation_threshold={sit.runtime.defrag.fragmentation_threshold:g}`; "
            f"auto-defrag checks every `defrag.check_interval_s="
            f"{sit.runtime.defrag.check_interval_s:g}` and skips pools with fewer than "
            f"`defrag.min_free_pages={sit.runtime.defrag.min_free_pages}` free pages"
        ),
        lambda sit: (
            f"Run {defrag_now(sit)}; if auto-defrag still does not start, look for defrag "
            "errors in the agent's log"
        ),
    ),
    Cause(
        always,
        lambda sit: f"{_last(sit)} and left it at {_before_after(sit)}",
        lambda sit: (
            f"Run {defrag_now(sit)} and compare fragmentation before and after in its output; "
            f"{text.patch(text.setting('defrag.fragmentation_target', 0.05))}"
        ),
    ),
)

DEFRAG_INEFFECTIVE = (
    Cause(
        _defrag_active,
        lambda sit: f"a defrag is running now and has not finished; {_last(sit)}",
        lambda sit: f"Let it finish; if runs keep taking this long, {longer_steps(sit)}",
    ),
    Cause(
        _last_moved_nothing,
        lambda sit: (
            f"{_last(sit)}: it found no page to move, so the "
            f"{sit.snapshot.free_extents} free extents stayed"
        ),
        lambda sit: (
            f"Run {defrag_now(sit)} and read `pages_moved` in its output; if it is 0 again, "
            f"save {text.pool_command(sit.agent_url, sit.snapshot, 'pool map --json')} for a "
            "bug report"
        ),
    ),
    Cause(
        _last_incomplete,
        lambda sit: f"{_last(sit)} but stopped before finishing ({_before_after(sit)})",
        lambda sit: f"Run {defrag_now(sit)} for a full pass; so runs finish, {longer_steps(sit)}",
    ),
    Cause(
        _last_lowered_it,
        lambda sit: (
            f"{_last(sit)} ({_before_after(sit)}), but requests ending at "
            "different times scatter free pages faster than defrag runs"
        ),
        lambda sit: text.sentence(sooner(sit, "Let auto-defrag run sooner and more often")),
    ),
    Cause(
        always,
        lambda sit: f"{_last(sit)} and finished at {_before_after(sit)}",
        lambda sit: (
            f"Run {defrag_now(sit)} and compare fragmentation before and after in its output; "
            f"{text.patch(text.setting('defrag.fragmentation_target', 0.05))}"
        ),
    ),
)

# ---- pool size ------------------------------------------------------------------------------

POOL_NEARLY_FULL = (
    Cause(
        _at_limit,
        lambda sit: (
            f"the pool is at its limit of {sit.snapshot.max_pool_pages} pages with "
            f"{sit.snapshot.requests_waiting} requests waiting"
        ),
        raise_limit,
    ),
    Cause(
        always,
        lambda sit: (
            f"{sit.snapshot.requests_running} running requests hold the pages, "
            f"{sit.snapshot.requests_waiting} more wait"
        ),
        grow,
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
        lambda sit: f"Run {shrink_pool(sit)}; {auto_shrink(sit, text.shrink_target(sit.snapshot))}",
    ),
)

# ---- the KV budget several models share -----------------------------------------------------


def _share(sit: Situation) -> PoolShare:
    share = sit.snapshot.share
    assert share is not None  # the budget alert reads only pools that share a budget
    return share


def _at_ceiling(sit: Situation) -> bool:
    return sit.snapshot.capacity_pages >= _share(sit).ceiling_pages


def _all_pressured(sit: Situation) -> bool:
    share = _share(sit)
    return share.pools_under_pressure >= share.pools_total


def _every(pools: int) -> str:
    return "both pools" if pools == 2 else f"all {pools} pools"


def _needs(sit: Situation) -> str:
    """What the pool asks for: "its waiting requests are short of 40 pages"."""
    short = _share(sit).short_pages
    if short <= 0:
        return "its requests are preempted or fail to allocate"
    return f"its waiting requests are short of {short} pages"


def _budget_now(sit: Situation) -> str:
    return larger_budget(sit, text.wanted_pages(sit.snapshot))


def _raised_ceiling(sit: Situation) -> str:
    """A higher ceiling for this model and the budget that lets the pool reach it."""
    snapshot = sit.snapshot
    pool, segment = snapshot.pool, snapshot.segment_pages
    ceiling = text.round_up(_share(sit).ceiling_pages * text.GROW_FACTOR, segment)
    more = ceiling - snapshot.capacity_pages
    return (
        f"Raise the ceiling of `{pool}` and the budget with it: restart the agent with "
        f"`max_pool_pages = {ceiling}` in its `[[models]]` entry (`--max-pool-pages` bounds every "
        f"model) and {larger_budget(sit, more)}"
    )


BUDGET_EXHAUSTED = (
    Cause(
        _at_ceiling,
        lambda sit: (
            f"{_needs(sit)}, but the pool is at its ceiling of {_share(sit).ceiling_pages} pages: "
            "it may not grow even when memory frees up"
        ),
        _raised_ceiling,
    ),
    Cause(
        lambda sit: _share(sit).pinned,
        lambda sit: (
            f"{_needs(sit)}, but an operator's resize pinned the pool at "
            f"{sit.snapshot.capacity_pages} pages: the agent moves no memory into it"
        ),
        lambda sit: (
            f"Release it with {release_pool(sit, sit.snapshot.pool)} so the agent sizes it "
            f"again; for memory now, restart the agent with {_budget_now(sit)}"
        ),
    ),
    Cause(
        _all_pressured,
        lambda sit: (
            f"{_needs(sit)}, and {_every(_share(sit).pools_total)} of the budget are under "
            "pressure: the models' load needs more KV memory than the budget holds"
        ),
        lambda sit: f"Restart the agent with {_budget_now(sit)}, or {move_model(sit)}",
    ),
    Cause(
        always,
        lambda sit: (
            f"{_needs(sit)}, while {_share(sit).pools_total - _share(sit).pools_under_pressure} "
            f"of the budget's {_share(sit).pools_total} pools are calm but give none: an "
            "operator's resize pinned them, they hold no whole segment beyond what they use and "
            "keep as headroom, or they have been calm for less than "
            f"`rebalance.calm_s={sit.runtime.rebalance.calm_s:g}`"
        ),
        lambda sit: (
            f"Release the pools an operator pinned with {release_pool(sit, 'NAME')} "
            f"({text.command(sit.agent_url, 'pool show')} shows which are), or restart the agent "
            f"with {_budget_now(sit)}"
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
        lambda sit: f"{keep_reused(sit)}; or give the cache room: {grow(sit)}",
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

PINS_CROWD_POOL = (
    Cause(
        always,
        lambda sit: (
            f"{sit.snapshot.prefix_pins} pinned prefixes keep {sit.snapshot.prefix_pinned_pages} "
            f"of the pool's {sit.snapshot.capacity_pages} pages from eviction, so waiting "
            "requests get only the rest"
        ),
        lambda sit: (
            f"See which pins hold most with {text.command(sit.agent_url, 'prefix ls')} and let "
            f"the least needed go with {text.command(sit.agent_url, 'prefix unpin ID')}; pin "
            f"with `--ttl` so pins end by themselves, or give the pool room: {grow(sit)}"
        ),
    ),
)

PREEMPTION_STORM = (
    Cause(
        _at_limit,
        lambda sit: f"the pool is at its limit of {sit.snapshot.max_pool_pages} pages",
        raise_limit,
    ),
    Cause(
        always,
        lambda sit: (
            f"the {sit.snapshot.requests_running} running requests outgrow the pool's "
            f"{sit.snapshot.capacity_pages} pages, so the youngest is preempted and recomputed"
        ),
        grow,
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
            f"environment; meanwhile give back spare pages with {trim_pool(sit)}"
        ),
    ),
    Cause(
        lambda sit: sit.snapshot.utilization_ratio < 0.5,
        lambda sit: (
            f"the KV pool holds {text.size(sit.snapshot.capacity_bytes)} of the GPU's "
            f"{text.size(_gpu(sit).total_bytes)} but only "
            f"{text.percent(sit.snapshot.utilization_ratio)} of it is in use"
        ),
        lambda sit: f"Give memory back with {shrink_pool(sit)}",
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


# ---- tiers below the device pool -----------------------------------------------------------


def _tier(sit: Situation) -> TierReading:
    name = sit.labels["tier"]
    return next(t for t in sit.snapshot.tiers if t.tier == name)


def _window(sit: Situation) -> TierWindow:
    name = sit.labels["tier"]
    return sit.tiers.get(name) or TierWindow(tier=name, seconds=sit.snapshot.window_seconds)


def _host_above(sit: Situation) -> bool:
    """A disk tier under a host tier that has room: the disk gets what the host lets go."""
    return sit.labels["tier"] == "disk" and any(
        t.tier == "host" and t.capacity_pages > 0 for t in sit.snapshot.tiers
    )


def _skips_short_hits(sit: Situation) -> bool:
    return sit.runtime.prefix_cache.tier_min_load_tokens > 0


def _stored_loaded(sit: Situation) -> str:
    w = _window(sit)
    return (
        f"{w.stored_pages} pages were stored into the {w.tier} tier and {w.loaded_pages} "
        "loaded back"
    )


def _off_or_smaller(sit: Situation) -> str:
    """Turn the tier off; when some pages do come back, a smaller tier may keep those."""
    tier = _tier(sit)
    off = tier_off(sit, tier.tier)
    if _window(sit).loaded_pages == 0 or tier.capacity_bytes < 2 * tier.page_bytes:
        return f"Turn the tier off with {off}"
    half = resize_tier(sit, tier.tier, tier.capacity_bytes // 2)
    return f"Turn the tier off with {off}, or, since a few pages do come back, halve it: {half}"


TIER_STORES_UNUSED = (
    Cause(
        _host_above,
        lambda sit: (
            f"{_stored_loaded(sit)}: the pages the host tier lets go are rarely asked for "
            "again, so the disk tier writes files nobody reads"
        ),
        lambda sit: f"{_off_or_smaller(sit)}; the host tier keeps what is reused",
    ),
    Cause(
        _skips_short_hits,
        lambda sit: (
            f"{_stored_loaded(sit)}: prefixes found below the device that are shorter than "
            "`prefix_cache.tier_min_load_tokens="
            f"{sit.runtime.prefix_cache.tier_min_load_tokens}` are computed, not loaded"
        ),
        lambda sit: (
            f"{_off_or_smaller(sit)}; or, if loads pay off for short prefixes, "
            f"{text.command(sit.agent_url, 'config set prefix_cache.tier_min_load_tokens=0')}"
        ),
    ),
    Cause(
        always,
        lambda sit: (
            f"{_stored_loaded(sit)}: prompts rarely come back to the prefixes the device "
            "evicted, so the tier costs memory and copies without saving prefill"
        ),
        _off_or_smaller,
    ),
)


def _cost(sit: Situation) -> str:
    """ "reading page files ... costs 1.2 ms a token, while computing one costs 0.4 ms"."""
    w = _window(sit)
    per_token = w.load_seconds / w.hits_tokens if w.hits_tokens else 0.0
    prefill = sit.snapshot.prefill_seconds_per_token or 0.0
    return (
        f"the {w.loaded_pages} pages ({w.hits_tokens} tokens) it loaded took "
        f"{text.seconds_per_token(per_token)} a token, while computing one takes "
        f"{text.seconds_per_token(prefill)}"
    )


TIER_LOADS_SLOWER_THAN_PREFILL = (
    Cause(
        lambda sit: sit.labels["tier"] == "disk",
        lambda sit: (
            f"{_cost(sit)}: reading and checking page files in {_tier(sit).path} is slower "
            "than the model recomputing them"
        ),
        lambda sit: (
            "Move the disk tier to faster storage (restart the agent with `--disk-tier-path` "
            f"on a local NVMe disk), skip short hits with {skip_short_hits(sit)}, or turn the "
            f"tier off with {tier_off(sit, 'disk')}"
        ),
    ),
    Cause(
        always,
        lambda sit: (
            f"{_cost(sit)}: copying pages from host memory is slower than the device "
            "recomputing them"
        ),
        lambda sit: (
            f"Skip short hits with {skip_short_hits(sit)}, or turn the tier off with "
            f"{tier_off(sit, sit.labels['tier'])}"
        ),
    ),
)


def _free(tier: TierReading) -> int:
    return tier.filesystem_free_bytes or 0


def _where(tier: TierReading) -> str:
    return f"the filesystem of {tier.path}" if tier.path else "its filesystem"


def _fit(sit: Situation) -> str:
    return resize_tier(sit, "disk", disk_tier_fit(sit))


TIER_STORE_FAILURES = (
    Cause(
        lambda sit: sit.labels["reason"] == "full",
        lambda sit: (
            f"the {_tier(sit).tier} tier ({_tier(sit).capacity_pages} pages) had no room and "
            "nothing it could evict for the pages handed to it at once, so they were dropped"
        ),
        lambda sit: (
            "Give the tier room with "
            f"{resize_tier(sit, _tier(sit).tier, 2 * _tier(sit).capacity_bytes)}, or turn it "
            f"off with {tier_off(sit, _tier(sit).tier)}"
        ),
    ),
    Cause(
        lambda sit: _tier(sit).filesystem_free_bytes is None,
        lambda sit: (
            f"writing page files into {_tier(sit).path} fails and its filesystem cannot be "
            "read: the directory is gone"
        ),
        lambda sit: (
            f"Recreate the directory (`mkdir -p {_tier(sit).path}`, writable by the agent's "
            f"user), or turn the tier off with {tier_off(sit, 'disk')}"
        ),
    ),
    Cause(
        lambda sit: _free(_tier(sit)) < 16 * _tier(sit).page_bytes,
        lambda sit: (
            f"writing page files into {_tier(sit).path} fails: {_where(_tier(sit))} is full "
            f"({text.size(_free(_tier(sit)))} free)"
        ),
        lambda sit: f"Shrink the disk tier to what fits with {_fit(sit)}, or free space there",
    ),
    Cause(
        always,
        lambda sit: (
            f"writing page files into {_tier(sit).path} fails although {_where(_tier(sit))} "
            f"has {text.size(_free(_tier(sit)))} free: the directory was removed, replaced "
            "or made read-only"
        ),
        lambda sit: (
            f"Restore the directory (`mkdir -p {_tier(sit).path}`, writable by the agent's "
            f"user; `ls -ld {_tier(sit).path}` shows what is there), or turn the tier off with "
            f"{tier_off(sit, 'disk')}"
        ),
    ),
)


def _room(sit: Situation) -> str:
    disk = _tier(sit)
    return (
        f"{_where(disk)} has {text.size(_free(disk))} free, while the disk tier holds "
        f"{text.size(disk.used_bytes)} of its {text.size(disk.capacity_bytes)}"
    )


DISK_TIER_FILESYSTEM_FULL = (
    Cause(
        lambda sit: _tier(sit).capacity_bytes > (_tier(sit).filesystem_size_bytes or 0),
        lambda sit: (
            f"{_room(sit)}: the tier is larger than the whole filesystem "
            f"({text.size(_tier(sit).filesystem_size_bytes or 0)}), so its stores will fail "
            "once the disk is full"
        ),
        lambda sit: f"Shrink the disk tier to what fits with {_fit(sit)}",
    ),
    Cause(
        always,
        lambda sit: (
            f"{_room(sit)}: other files take the space it counts on, so its stores will fail "
            "once the disk is full"
        ),
        lambda sit: f"Shrink the disk tier to what fits with {_fit(sit)}, or free space there",
    ),
)
