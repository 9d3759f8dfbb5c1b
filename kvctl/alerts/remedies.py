"""Remedies: the exact `kvctl` command or runtime setting an alert suggests, with a value to try.

Every remedy reads the runtime settings in force (`Situation.runtime`) and never suggests a
setting that already holds its value: an on-call engineer told to set what is set stops trusting
the rest. When nothing is left to change, it says what the setting in force already does.
"""

from __future__ import annotations

from kvctl.alerts import text
from kvctl.alerts.definition import Situation

RESIZE_HIGH_WATER = 0.85
"""`resize.high_water` to suggest: grow before the pool is full, not when it is."""
DEFRAG_STEP_PAGES = 256
"""`defrag.step_max_pages` to suggest when runs stop before finishing (the default is 64)."""
DEFRAG_CHECK_INTERVAL_S = 2
"""`defrag.check_interval_s` to suggest when fragmentation regrows between checks."""
GPU_MEMORY_FRACTION = 0.8
"""`--gpu-memory-fraction` to suggest when the device is nearly full."""
RESTART = "`systemctl restart kvctl-agent` (Kubernetes: delete the pod)"
"""How to restart an agent, for the states only a restart clears."""
TIER_MIN_LOAD_TOKENS = 256
"""`prefix_cache.tier_min_load_tokens` to suggest when loads cost more than compute: a load's
fixed costs (a file per page, a copy per hit) weigh most on short hits."""
DISK_FREE_KEEP = 0.1
"""A disk tier resized to fit its filesystem leaves this share of the free space to others."""


def raise_limit(sit: Situation) -> str:
    """A larger `--max-pool-pages`: at its limit the pool cannot grow at run time. A pool that
    shares a budget grows within it: its limit is the budget (and its own `max_pool_pages`)."""
    snapshot = sit.snapshot
    if snapshot.share is not None:
        return (
            f"Restart the agent with a larger `--kv-budget` (now "
            f"{text.size(snapshot.share.budget_bytes)} for all its pools), or a higher "
            f"`max_pool_pages` for model `{snapshot.pool}` than its "
            f"{snapshot.share.ceiling_pages}, if the device has the memory; otherwise send "
            "fewer concurrent or shorter requests"
        )
    return (
        f"Restart the agent with `--max-pool-pages {text.raised_limit(snapshot)}` if the "
        "device has the memory; otherwise send fewer concurrent or shorter requests"
    )


def auto_grow(sit: Situation, target: int) -> str:
    """What makes the pool grow by itself, from the resize settings in force."""
    resize = sit.runtime.resize
    changes = []
    if not resize.enabled:
        changes.append(text.setting("resize.enabled", True))
    if resize.high_water > RESIZE_HIGH_WATER:
        changes.append(text.setting("resize.high_water", RESIZE_HIGH_WATER))
    if resize.max_pages is not None and resize.max_pages < target:
        changes.append(text.setting("resize.max_pages", target))
    if changes:
        return f"to grow on demand, {text.patch(*changes)}"
    return (
        f"automatic resize is on and grows one segment once the pool stays above "
        f"`resize.high_water={resize.high_water:g}` for `resize.window_s={resize.window_s:g}`"
    )


def grow(sit: Situation) -> str:
    """A quarter more pool now, and what makes it grow by itself; at the limit, a restart."""
    target = text.grow_target(sit.snapshot)
    if target is None:
        return raise_limit(sit)
    if sit.snapshot.share is not None:
        return grow_in_budget(sit, target)
    resize = text.pool_command(sit.agent_url, sit.snapshot, f"pool resize --pages {target}")
    return f"Run {resize}; {auto_grow(sit, target)}"


def grow_in_budget(sit: Situation, target: int) -> str:
    """In a shared budget: a resize when the budget has the room (it pins the pool), else where
    the room must come from. The rebalancer moves memory from calm pools by itself."""
    snapshot, share = sit.snapshot, sit.snapshot.share
    assert share is not None
    needed = (target - snapshot.capacity_pages) * snapshot.bytes_per_page
    if share.unassigned_bytes >= needed:
        resize = text.pool_command(sit.agent_url, snapshot, f"pool resize --pages {target}")
        return (
            f"Run {resize} (it pins the pool; {release_pool(sit, snapshot.pool)} hands it "
            "back to the agent, which moves memory from calm pools to pools under pressure)"
        )
    return (
        f"The KV budget has {text.size(share.unassigned_bytes)} unassigned, less than the "
        f"{text.size(needed)} this needs: shrink a pool that has room "
        f"({text.command(sit.agent_url, 'pool show')} shows each pool's reclaimable pages), or "
        f"restart with a larger `--kv-budget`; {share.donors} pools can give memory now, and "
        "the agent moves it from calm pools by itself"
    )


def auto_shrink(sit: Situation, target: int) -> str:
    """What makes the pool shrink by itself, from the resize settings in force."""
    resize = sit.runtime.resize
    changes = []
    if not resize.enabled:
        changes.append(text.setting("resize.enabled", True))
    if resize.min_pages is not None and resize.min_pages > target:
        changes.append(text.setting("resize.min_pages", target))
    if changes:
        return f"to shrink automatically, {text.patch(*changes)}"
    return (
        f"automatic resize is on and shrinks one segment once the pool stays below "
        f"`resize.low_water={resize.low_water:g}` for `resize.window_s={resize.window_s:g}`"
    )


def shrink_pool(sit: Situation) -> str:
    """The resize that leaves what is in use half the pool, room for a burst."""
    pages = text.shrink_target(sit.snapshot)
    return text.pool_command(sit.agent_url, sit.snapshot, f"pool resize --pages {pages}")


def trim_pool(sit: Situation) -> str:
    """The resize that frees device memory but keeps a tenth spare."""
    pages = text.trim_target(sit.snapshot)
    return text.pool_command(sit.agent_url, sit.snapshot, f"pool resize --pages {pages}")


def defrag_now(sit: Situation) -> str:
    """A full defragmentation pass now, whatever the automatic thresholds say."""
    return text.pool_command(sit.agent_url, sit.snapshot, "defrag --now")


def lower_fragmentation_threshold(fragmentation_max: float) -> float:
    """A `defrag.fragmentation_threshold` that lets auto-defrag act before the alert fires."""
    return round(max(0.1, fragmentation_max - 0.2), 2)


def lower_threshold(sit: Situation) -> str | None:
    """A lower `defrag.fragmentation_threshold`, unless the one in force is that low already."""
    lower = lower_fragmentation_threshold(sit.settings.fragmentation_max)
    if sit.runtime.defrag.fragmentation_threshold <= lower:
        return None
    return text.setting("defrag.fragmentation_threshold", lower)


def sooner(sit: Situation, lead: str) -> str:
    """`lead`, then the settings that make auto-defrag act sooner and more often, those not in
    force yet; or what it already does when all of them are."""
    defrag = sit.runtime.defrag
    changes = [lower_threshold(sit)]
    if defrag.check_interval_s > DEFRAG_CHECK_INTERVAL_S:
        changes.append(text.setting("defrag.check_interval_s", DEFRAG_CHECK_INTERVAL_S))
    if not defrag.enabled:
        changes.insert(0, text.setting("defrag.enabled", True))
    wanted = [c for c in changes if c]
    if wanted:
        return f"{lead}, {text.patch(*wanted)}"
    return (
        f"auto-defrag already checks every `defrag.check_interval_s={defrag.check_interval_s:g}`"
        f" above `defrag.fragmentation_threshold={defrag.fragmentation_threshold:g}`; a larger "
        "pool leaves more free room and scatters slower"
    )


def longer_steps(sit: Situation) -> str:
    """A defrag step budget larger than the one in force."""
    defrag = sit.runtime.defrag
    if defrag.step_max_pages < DEFRAG_STEP_PAGES:
        return text.patch(text.setting("defrag.step_max_pages", DEFRAG_STEP_PAGES))
    longer = round(min(1.0, defrag.step_max_seconds * 2), 4)
    return text.patch(text.setting("defrag.step_max_seconds", longer))


def keep_reused(sit: Situation) -> str:
    """LFU eviction keeps prefixes that many requests share, unless it is already in force."""
    if sit.runtime.prefix_cache.eviction_policy == "lfu":
        return "eviction already keeps the most reused prefixes (`lfu`)"
    lfu = text.setting("prefix_cache.eviction_policy", "lfu")
    return f"Keep often reused prefixes: {text.patch(lfu)}"


def keep_evidence(sit: Situation) -> str:
    """For states only a bug explains: what to save before the restart that clears them."""
    return (
        f"save {text.pool_command(sit.agent_url, sit.snapshot, 'pool show --json')} and the "
        f"agent's log for a bug report, then restart it: {RESTART}"
    )


def unblock(sit: Situation) -> str:
    """Room for the head of the queue now, or a restart when the pool may not grow."""
    target = text.grow_target(sit.snapshot)
    if target is None:
        return f"The pool may not grow: {keep_evidence(sit)}"
    resize = text.pool_command(sit.agent_url, sit.snapshot, f"pool resize --pages {target}")
    return f"Admit the waiting requests with {resize}; {keep_evidence(sit)}"


def resize_tier(sit: Situation, tier: str, size_bytes: float) -> str:
    """The command that gives tier `tier` room for `size_bytes` (0 turns it off)."""
    return text.pool_command(
        sit.agent_url, sit.snapshot, f"pool resize --tier {tier} --size {text.size_arg(size_bytes)}"
    )


def tier_off(sit: Situation, tier: str) -> str:
    """The command that turns tier `tier` off (its pages are dropped or handed down)."""
    return resize_tier(sit, tier, 0)


def disk_tier_fit(sit: Situation) -> int:
    """A disk tier size that fits its filesystem: what it holds plus the free space, less a
    tenth of that free space left to others."""
    disk = next(t for t in sit.snapshot.tiers if t.tier == "disk")
    free = disk.filesystem_free_bytes or 0
    return disk.used_bytes + int(free * (1.0 - DISK_FREE_KEEP))


def skip_short_hits(sit: Situation) -> str:
    """A larger `prefix_cache.tier_min_load_tokens`, so short hits are computed, not loaded."""
    current = sit.runtime.prefix_cache.tier_min_load_tokens
    tokens = max(TIER_MIN_LOAD_TOKENS, 2 * current)
    return text.command(sit.agent_url, f"config set prefix_cache.tier_min_load_tokens={tokens}")


def larger_budget(sit: Situation, pages: int) -> str:
    """The `--kv-budget` flag that gives this pool `pages` more, rounded up to a size to paste:
    a budget changes only at a restart."""
    snapshot, share = sit.snapshot, sit.snapshot.share
    assert share is not None  # only pools that share a budget have one
    more = pages * snapshot.bytes_per_page
    return (
        f"`--kv-budget {text.size_arg_up(share.budget_bytes + more)}` ({text.size(more)} more: "
        f"{pages} pages of `{snapshot.pool}`)"
    )


def move_model(sit: Situation) -> str:
    """Serving a model elsewhere frees its whole pool for the others; this pool's share of the
    budget says how much moving this one would free."""
    snapshot, share = sit.snapshot, sit.snapshot.share
    assert share is not None
    held = snapshot.capacity_bytes / share.budget_bytes
    most = ", the most of any pool" if held > 0.5 else ""
    return (
        "move a model to another agent (restart this one without its `--model`): "
        f"`{snapshot.pool}` holds {text.size(snapshot.capacity_bytes)} ({text.percent(held)}) of "
        f"the budget{most}"
    )


def release_pool(sit: Situation, name: str) -> str:
    """The command that hands a pinned pool back to the rebalancer."""
    return text.command(sit.agent_url, f"pool release --pool {name}")
