"""The tier alerts on sequences of snapshots: each fires on what should fire it, stays quiet
otherwise, holds down to its clear level and resolves, and names the command that fixes it.

The tier alerts read counters over the agent's stats window, so each case is a sequence: the
evaluator keeps the totals it saw and alerts on their increase. Snapshots come one minute apart
with a one-minute window, so each step's increase is the window's (a longer window is tested
too).
"""

from __future__ import annotations

from typing import Any

import pytest
from pool_readings import DISK_PATH, pool_snapshot, tier_reading

from kvctl import api
from kvctl.alerts import AlertEvaluator
from kvctl.alerts.evaluator import CounterWindow, TierHistory

T0 = 1_700_000_000.0
AGENT = "http://node-1:8477"
GIB = 1 << 30
STEP = 60.0


class Timeline:
    """An evaluator fed snapshots `STEP` seconds apart, with tier counters given as totals."""

    def __init__(self, window: float = STEP, **settings: Any) -> None:
        self.now = T0
        self.window = window
        runtime = settings.pop("runtime", None)
        alerts = api.AlertSettings(**{"for_s": 0, **settings})
        self.evaluator = AlertEvaluator(runtime or alerts, "demo", "node-1:8477", lambda: self.now)

    def step(self, *tiers: api.TierReading, **fields: Any) -> dict[tuple, api.Alert]:
        """Evaluate one snapshot with `tiers`; the active alerts by (name, tier, reason)."""
        snapshot = pool_snapshot(tiers=list(tiers), window_seconds=self.window, **fields)
        alerts = self.evaluator.evaluate(snapshot)
        self.now += STEP
        return {(a.name, a.labels.get("tier"), a.labels.get("reason")): a for a in alerts}


def host(**fields: Any) -> api.TierReading:
    return tier_reading("host", **fields)


def disk(**fields: Any) -> api.TierReading:
    return tier_reading("disk", **fields)


def names(alerts: dict[tuple, api.Alert]) -> set[tuple]:
    return set(alerts)


def only(alerts: dict[tuple, api.Alert], key: tuple) -> api.Alert:
    assert set(alerts) == {key}, set(alerts)
    return alerts[key]


# ---- KvctlTierStoresUnused --------------------------------------------------------------------

UNUSED = ("KvctlTierStoresUnused", "host", None)


def test_a_tier_that_stores_and_never_loads_fires_and_resolves_when_stores_stop() -> None:
    t = Timeline()
    assert t.step(host()) == {}  # the first snapshot only starts the history
    alert = only(t.step(host(stored_pages_total=500, used_pages=500)), UNUSED)
    assert (alert.state, alert.severity, alert.value) == ("firing", "warning", 0.0)
    assert alert.labels["tier"] == "host"
    assert alert.summary == "The host tier of pool demo at node-1:8477 stores pages nobody loads"
    assert alert.description == (
        "the host tier loaded back 0% as many pages as it stored over the last 60 s; 500 pages "
        "were stored into the host tier and 0 loaded back: prompts rarely come back to the "
        "prefixes the device evicted, so the tier costs memory and copies without saving prefill"
    )
    assert alert.remediation == (
        f"Turn the tier off with `kvctl --agent {AGENT} pool resize --tier host --size 0`"
    )
    assert alert.runbook_url == f"{AGENT}/runbook#kvctltierstoresunused"
    # stores go on: still firing; stores stop: nothing stored in the window, resolved
    assert UNUSED in t.step(host(stored_pages_total=900, used_pages=900))
    assert t.step(host(stored_pages_total=900, used_pages=900)) == {}


def test_a_tier_whose_pages_come_back_is_quiet() -> None:
    t = Timeline()
    t.step(host())
    assert t.step(host(stored_pages_total=500, loaded_pages_total=100)) == {}  # 20 %


def test_a_few_stores_are_not_a_trend() -> None:
    t = Timeline()
    t.step(host())
    assert t.step(host(stored_pages_total=63)) == {}  # under tier_stores_min (64)
    assert UNUSED in t.step(host(stored_pages_total=63 + 64))


def test_reuse_holds_down_to_its_clear_level() -> None:
    """Fires under 5 % loads per store, holds below 10 %, resolves at 10 %."""
    t = Timeline()
    t.step(host())
    stored = loaded = 0
    for loads_per_100, expected in [(4, True), (8, True), (9, True), (10, False), (8, False)]:
        stored += 1000
        loaded += loads_per_100 * 10
        alerts = t.step(host(stored_pages_total=stored, loaded_pages_total=loaded))
        assert (UNUSED in alerts) == expected, loads_per_100


def test_the_first_pages_of_a_tier_need_the_long_for() -> None:
    """A tier filling up after a start stores without loads: 10× alert-for before it fires."""
    t = Timeline(window=300.0, for_s=60)
    t.step(host())
    stored = 0
    states = []
    for _ in range(12):
        stored += 200
        states.append(t.step(host(stored_pages_total=stored)).get(UNUSED))
    assert [a.state for a in states[:10]] == ["pending"] * 10
    assert [a.state for a in states[10:]] == ["firing"] * 2


def test_a_half_size_is_offered_when_a_few_pages_come_back() -> None:
    t = Timeline()
    t.step(host())
    alert = t.step(host(stored_pages_total=1000, loaded_pages_total=20))[UNUSED]
    assert alert.remediation == (
        f"Turn the tier off with `kvctl --agent {AGENT} pool resize --tier host --size 0`, or, "
        "since a few pages do come back, halve it: "
        f"`kvctl --agent {AGENT} pool resize --tier host --size 32MiB`"
    )


def test_a_disk_tier_under_a_host_tier_gets_the_cold_pages() -> None:
    t = Timeline()
    t.step(host(), disk())
    alerts = t.step(
        host(stored_pages_total=500, loaded_pages_total=400), disk(stored_pages_total=300)
    )
    alert = only(alerts, ("KvctlTierStoresUnused", "disk", None))
    assert alert.description.endswith(
        "300 pages were stored into the disk tier and 0 loaded back: the pages the host tier "
        "lets go are rarely asked for again, so the disk tier writes files nobody reads"
    )
    assert alert.remediation == (
        f"Turn the tier off with `kvctl --agent {AGENT} pool resize --tier disk --size 0`; the "
        "host tier keeps what is reused"
    )


def test_skipped_short_hits_are_named() -> None:
    runtime = api.RuntimeSettings.model_validate(
        {"alerts": {"for_s": 0}, "prefix_cache": {"tier_min_load_tokens": 512}}
    )
    t = Timeline(runtime=runtime)
    t.step(host())
    alert = t.step(host(stored_pages_total=500))[UNUSED]
    assert "shorter than `prefix_cache.tier_min_load_tokens=512` are computed" in (
        alert.description
    )
    assert alert.remediation.endswith(
        f"`kvctl --agent {AGENT} config set prefix_cache.tier_min_load_tokens=0`"
    )


# ---- KvctlTierLoadsSlowerThanPrefill ----------------------------------------------------------

SLOW = ("KvctlTierLoadsSlowerThanPrefill", "host", None)
PREFILL = 0.0004  # seconds per prompt token


def loads(tier: str = "host", pages: int = 0, seconds: float = 0.0, **fields: Any):
    """A tier that loaded `pages` pages (16 tokens each) in `seconds` since start."""
    return tier_reading(
        tier,
        loaded_pages_total=pages,
        hits_tokens_total=16 * pages,
        load_seconds_total=seconds,
        **fields,
    )


def test_loads_slower_than_prefill_fire_with_the_numbers() -> None:
    t = Timeline()
    t.step(loads(), prefill_seconds_per_token=PREFILL)
    alerts = t.step(loads(pages=100, seconds=2.0), prefill_seconds_per_token=PREFILL)
    alert = only(alerts, SLOW)
    assert alert.value == pytest.approx(2.0 / 1600 / PREFILL)  # 3.125×
    assert alert.description == (
        "loading a prompt token from the host tier took 3.12 times as long as computing it over "
        "the last 60 s; the 100 pages (1600 tokens) it loaded took 1.25 ms a token, while "
        "computing one takes 400 µs: copying pages from host memory is slower than the device "
        "recomputing them"
    )
    assert alert.remediation == (
        f"Skip short hits with `kvctl --agent {AGENT} config set "
        "prefix_cache.tier_min_load_tokens=256`, or turn the tier off with "
        f"`kvctl --agent {AGENT} pool resize --tier host --size 0`"
    )


def test_fast_loads_few_loads_and_an_unmeasured_prefill_are_quiet() -> None:
    t = Timeline()
    t.step(loads(), prefill_seconds_per_token=PREFILL)
    fast = t.step(loads(pages=100, seconds=0.2), prefill_seconds_per_token=PREFILL)
    assert fast == {}  # 0.125 ms a token
    few = t.step(loads(pages=115, seconds=2.2), prefill_seconds_per_token=PREFILL)
    assert few == {}  # 15 pages, under tier_loads_min (16)
    unmeasured = t.step(loads(pages=215, seconds=4.2), prefill_seconds_per_token=None)
    assert unmeasured == {}


def test_load_cost_holds_down_to_its_clear_level_and_resolves_without_loads() -> None:
    t = Timeline()
    pages, seconds = 0, 0.0
    t.step(loads(), prefill_seconds_per_token=PREFILL)
    for cost, expected in [(1.5, True), (0.9, True), (0.81, True), (0.79, False), (0.9, False)]:
        pages += 100
        seconds += cost * PREFILL * 1600
        alerts = t.step(loads(pages=pages, seconds=seconds), prefill_seconds_per_token=PREFILL)
        assert (SLOW in alerts) == expected, cost
    t.step(loads(pages=pages, seconds=seconds), prefill_seconds_per_token=PREFILL)
    pages += 100
    seconds += 2 * PREFILL * 1600
    assert SLOW in t.step(loads(pages=pages, seconds=seconds), prefill_seconds_per_token=PREFILL)
    assert t.step(loads(pages=pages, seconds=seconds), prefill_seconds_per_token=PREFILL) == {}


def test_a_slow_disk_tier_is_told_to_move_and_short_hits_skipped_further() -> None:
    runtime = api.RuntimeSettings.model_validate(
        {"alerts": {"for_s": 0}, "prefix_cache": {"tier_min_load_tokens": 256}}
    )
    t = Timeline(runtime=runtime)
    t.step(loads("disk"), prefill_seconds_per_token=PREFILL)
    alerts = t.step(loads("disk", pages=50, seconds=4.0), prefill_seconds_per_token=PREFILL)
    alert = only(alerts, ("KvctlTierLoadsSlowerThanPrefill", "disk", None))
    assert f"reading and checking page files in {DISK_PATH} is slower" in alert.description
    assert alert.remediation == (
        "Move the disk tier to faster storage (restart the agent with `--disk-tier-path` on a "
        f"local NVMe disk), skip short hits with `kvctl --agent {AGENT} config set "
        "prefix_cache.tier_min_load_tokens=512`, or turn the tier off with "
        f"`kvctl --agent {AGENT} pool resize --tier disk --size 0`"
    )


# ---- KvctlTierStoreFailures -------------------------------------------------------------------

IO = ("KvctlTierStoreFailures", "disk", "io")


def failures(tier: str = "disk", full: int = 0, io: int = 0, **fields: Any):
    return tier_reading(tier, store_failures_total={"full": full, "io": io}, **fields)


def test_io_failures_fire_per_reason_and_resolve_after_a_window_without_any() -> None:
    t = Timeline()
    assert t.step(failures()) == {}
    alert = only(t.step(failures(io=12)), IO)
    assert (alert.value, alert.severity, alert.state) == (12, "warning", "firing")
    assert alert.labels["reason"] == "io"
    assert alert.summary == (
        "Pages fail to be stored into the disk tier of pool demo at node-1:8477"
    )
    assert alert.description == (
        "12 pages failed to be stored into the disk tier (io) over the last 60 s; writing page "
        f"files into {DISK_PATH} fails although the filesystem of {DISK_PATH} has 500.0 GiB "
        "free: the directory was removed, replaced or made read-only"
    )
    assert alert.remediation == (
        f"Restore the directory (`mkdir -p {DISK_PATH}`, writable by the agent's user; "
        f"`ls -ld {DISK_PATH}` shows what is there), or turn the tier off with "
        f"`kvctl --agent {AGENT} pool resize --tier disk --size 0`"
    )
    assert IO in t.step(failures(io=20))  # still failing
    assert t.step(failures(io=20)) == {}  # a window without a failure: resolved


def test_no_failure_is_quiet_and_a_threshold_tolerates_some() -> None:
    t = Timeline(tier_store_failures_max=10)
    t.step(failures())
    assert t.step(failures()) == {}
    assert t.step(failures(io=10)) == {}  # 10 is tolerated
    assert IO in t.step(failures(io=21))
    assert IO in t.step(failures(io=27))  # 6: above the clear level (5)
    assert t.step(failures(io=32)) == {}  # 5: resolved


def test_a_full_tier_is_told_to_grow() -> None:
    t = Timeline()
    t.step(failures("host"))
    alert = only(t.step(failures("host", full=40)), ("KvctlTierStoreFailures", "host", "full"))
    assert alert.description.endswith(
        "the host tier (1024 pages) had no room and nothing it could evict for the pages handed "
        "to it at once, so they were dropped"
    )
    assert alert.remediation == (
        f"Give the tier room with `kvctl --agent {AGENT} pool resize --tier host --size "
        f"128MiB`, or turn it off with `kvctl --agent {AGENT} pool resize --tier host --size 0`"
    )


def test_a_gone_directory_and_a_full_disk_are_told_apart() -> None:
    t = Timeline()
    t.step(failures())
    gone = t.step(failures(io=5, filesystem_free_bytes=None, filesystem_size_bytes=None))[IO]
    assert gone.description.endswith(
        f"writing page files into {DISK_PATH} fails and its filesystem cannot be read: the "
        "directory is gone"
    )
    t = Timeline()
    t.step(failures())
    full = t.step(failures(io=5, used_pages=1000, filesystem_free_bytes=4096))[IO]
    assert full.description.endswith(
        f"writing page files into {DISK_PATH} fails: the filesystem of {DISK_PATH} is full "
        "(4.0 KiB free)"
    )
    assert full.remediation == (
        "Shrink the disk tier to what fits with "
        f"`kvctl --agent {AGENT} pool resize --tier disk --size 62MiB`, or free space there"
    )


# ---- KvctlDiskTierFilesystemFull --------------------------------------------------------------

FULL = ("KvctlDiskTierFilesystemFull", "disk", None)
PAGE_FILE = 65536 + 48


def test_a_disk_tier_larger_than_the_free_space_fires_at_once_and_a_resize_resolves_it() -> None:
    t = Timeline()
    huge = disk(capacity_pages=20_000_000, used_pages=1000, filesystem_free_bytes=100 * GIB)
    alert = only(t.step(huge), FULL)  # reads the snapshot: no history needed
    assert alert.value == pytest.approx(100 * GIB / (19_999_000 * PAGE_FILE))
    assert (
        alert.summary == "The disk tier of pool demo at node-1:8477 will not fit on its filesystem"
    )
    assert alert.description == (
        "the disk tier's filesystem has 8.186% of the space the tier may still fill free; the "
        f"filesystem of {DISK_PATH} has 100.0 GiB free, while the disk tier holds 62.5 MiB of "
        "its 1.2 TiB: the tier is larger than the whole filesystem (1.0 TiB), so its stores "
        "will fail once the disk is full"
    )
    fits = 1000 * PAGE_FILE + int(100 * GIB * 0.9)  # what it holds, and 90 % of the free space
    assert fits // GIB == 90
    assert alert.remediation == (
        f"Shrink the disk tier to what fits with `kvctl --agent {AGENT} pool resize --tier disk "
        "--size 90GiB`"
    )
    resized = disk(
        capacity_pages=90 * GIB // PAGE_FILE, used_pages=1000, filesystem_free_bytes=100 * GIB
    )
    assert t.step(resized) == {}


def test_other_files_taking_the_space_are_named() -> None:
    t = Timeline()
    crowded = disk(capacity_pages=100_000, used_pages=10_000, filesystem_free_bytes=2 * GIB)
    alert = only(t.step(crowded), FULL)
    assert alert.description.endswith(
        f"the filesystem of {DISK_PATH} has 2.0 GiB free, while the disk tier holds 625.5 MiB "
        "of its 6.1 GiB: other files take the space it counts on, so its stores will fail once "
        "the disk is full"
    )
    assert alert.remediation == (
        f"Shrink the disk tier to what fits with `kvctl --agent {AGENT} pool resize --tier disk "
        "--size 2468MiB`, or free space there"
    )


def test_headroom_holds_down_to_its_clear_level() -> None:
    t = Timeline()
    expected = (1024 - 24) * PAGE_FILE  # what the default tier may still fill
    for free_share, firing in [(0.99, True), (1.04, True), (1.06, False), (1.01, False)]:
        tier = disk(used_pages=24, filesystem_free_bytes=int(expected * free_share))
        assert (FULL in t.step(tier)) == firing, free_share


def test_a_full_or_off_tier_or_an_unreadable_filesystem_expects_nothing() -> None:
    t = Timeline()
    tiny = dict(filesystem_free_bytes=1024)
    assert t.step(disk(used_pages=1024, **tiny)) == {}  # full: nothing more to store
    assert t.step(disk(capacity_pages=0, **tiny)) == {}  # off
    assert t.step(disk(filesystem_free_bytes=None)) == {}  # the directory is gone
    assert t.step(host(capacity_pages=1 << 30)) == {}  # host memory has no filesystem
    assert t.step(disk()) == {}  # 500 GiB free for 64 MiB: plenty


# ---- the window ------------------------------------------------------------------------------


def test_the_window_follows_the_agents_stats_window() -> None:
    """Over a 5-minute window, a burst of stores stays in view for five minutes, then leaves."""
    t = Timeline(window=300.0)
    t.step(host())
    seen = [UNUSED in t.step(host(stored_pages_total=500))]
    for _ in range(6):
        seen.append(UNUSED in t.step(host(stored_pages_total=500)))
    assert seen == [True, True, True, True, True, False, False]


def test_counter_window_restarts_with_the_counters() -> None:
    window = CounterWindow()
    assert window.update(0, {"a": 5}, 60) is None
    assert window.update(60, {"a": 9}, 60) == (60, {"a": 4})
    assert window.update(120, {"a": 2}, 60) is None  # went back: a restart, history anew
    assert window.update(180, {"a": 3}, 60) == (60, {"a": 1})


def test_a_tier_gone_from_the_snapshot_loses_its_history() -> None:
    history = TierHistory()
    assert history.update(T0, pool_snapshot(tiers=[host(stored_pages_total=10)])) == {}
    [window] = history.update(T0 + 60, pool_snapshot(tiers=[host(stored_pages_total=30)])).values()
    assert (window.tier, window.seconds, window.stored_pages) == ("host", 60, 20)
    assert history.update(T0 + 120, pool_snapshot()) == {}
    assert history.update(T0 + 180, pool_snapshot(tiers=[host(stored_pages_total=90)])) == {}
