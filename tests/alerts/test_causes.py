"""Cause analysis: each likely cause is chosen from the agent's state and names its fix.

Each case is a pool state, the alert it raises, and the exact explanation and remediation an
on-call engineer reads. Remedies read the runtime settings in force: they never suggest what is
already set.
"""

from __future__ import annotations

import pytest

from kvctl import api
from kvctl.alerts import AlertEvaluator, text

T0 = 1_700_000_000.0
AGENT = "http://node-1:8477"
GIB = 1 << 30


def defrag(before: float, after: float, moved: int, complete: bool = True) -> api.DefragResult:
    return api.DefragResult(
        trigger="threshold",
        fragmentation_before=before,
        fragmentation_after=after,
        free_extents_before=37,
        free_extents_after=30,
        pages_moved=moved,
        bytes_moved=moved * 65536,
        seconds=0.02,
        complete=complete,
    )


def gpu(used: float, split: float = 0.0) -> list[api.GpuMemory]:
    return [
        api.GpuMemory(
            index=0,
            name="H100",
            used_bytes=int(used * GIB),
            total_bytes=80 * GIB,
            torch_inactive_split_bytes=int(split * GIB),
        )
    ]


FRAGMENTED = dict(fragmentation=0.71, used_pages=244, free_pages=212, free_extents=37)
FULL = dict(used_pages=492, cached_pages=5)
FAILING = dict(window_alloc_attempts=100, window_alloc_failures=10)
STALLED = dict(requests_waiting=8, requests_running=0, queue_stalled_seconds=120.0)
WAITING = dict(requests_waiting=12, oldest_waiting_seconds=90.0)

CASES = [
    # (alert, changes, expected description after the headline, expected remediation)
    (
        "KvctlAllocationFailures",
        dict(FAILING, max_pool_pages=512, used_pages=512, cached_pages=0),
        "the pool is at its limit of 512 pages (0 free, 0 cached) and may not grow",
        "Restart the agent with `--max-pool-pages 640` if the device has the memory; otherwise "
        "send fewer concurrent or shorter requests",
    ),
    (
        "KvctlAllocationFailures",
        dict(FAILING, requests_waiting=6, used_pages=507, cached_pages=0),
        "6 requests wait while running requests hold 99.02% of the pool: demand outgrows its 512 "
        "pages",
        f"Run `kvctl --agent {AGENT} pool resize --pages 640`; to grow on demand, set "
        "`resize.enabled=true` and `resize.high_water=0.85` (PATCH /v1/config)",
    ),
    (
        "KvctlAllocationFailures",
        dict(FAILING, max_pool_pages=600),
        "the pool (512 pages, 39.06% held by running requests) ran out of free and evictable "
        "pages in a burst",
        f"Run `kvctl --agent {AGENT} pool resize --pages 600`; to grow on demand, set "
        "`resize.enabled=true` and `resize.high_water=0.85` (PATCH /v1/config)",
    ),
    (
        "KvctlFragmentationHigh",
        dict(FRAGMENTED, defrag_active=True),
        "a defrag is running now; no defrag has run since the agent started",
        f"Let the running defrag finish and check with `kvctl --agent {AGENT} pool show`; if it "
        "recurs, set `defrag.step_max_pages=256` (PATCH /v1/config)",
    ),
    (
        "KvctlFragmentationHigh",
        dict(
            FRAGMENTED,
            auto_defrag_enabled=False,
            last_defrag=defrag(0.7, 0.7, 0),
            last_defrag_age_seconds=840.0,
        ),
        "last defrag 14 min ago moved 0 pages; auto-defrag is off",
        f"Run `kvctl --agent {AGENT} defrag --now`, then set `defrag.enabled=true` "
        "(PATCH /v1/config) to keep it low",
    ),
    (
        "KvctlFragmentationHigh",
        dict(FRAGMENTED, last_defrag=defrag(0.8, 0.6, 64, False), last_defrag_age_seconds=30.0),
        "last defrag 30 s ago moved 64 pages and stopped before finishing (0.80 → 0.60)",
        f"Run `kvctl --agent {AGENT} defrag --now` for a full pass; so runs finish, set "
        "`defrag.step_max_pages=256` (PATCH /v1/config)",
    ),
    (
        "KvctlFragmentationHigh",
        dict(FRAGMENTED, last_defrag=defrag(0.6, 0.02, 150), last_defrag_age_seconds=7200.0),
        "last defrag 2.0 h ago moved 150 pages (0.60 → 0.02), but requests ending at different "
        "times have scattered the free pages again",
        f"Run `kvctl --agent {AGENT} defrag --now`; to let auto-defrag act sooner, set "
        "`defrag.fragmentation_threshold=0.3` and `defrag.check_interval_s=2` (PATCH /v1/config)",
    ),
    (
        "KvctlFragmentationHigh",
        FRAGMENTED,
        "no defrag has run since the agent started although fragmentation is above "
        "`defrag.fragmentation_threshold=0.5`; auto-defrag checks every "
        "`defrag.check_interval_s=5` and skips pools with fewer than `defrag.min_free_pages=16` "
        "free pages",
        f"Run `kvctl --agent {AGENT} defrag --now`; if auto-defrag still does not start, look "
        "for defrag errors in the agent's log",
    ),
    (
        "KvctlDefragIneffective",
        dict(FRAGMENTED, last_defrag=defrag(0.71, 0.71, 0), last_defrag_age_seconds=120.0),
        "last defrag 2 min ago moved 0 pages: it found no page to move, so the 37 free extents "
        "stayed",
        f"Run `kvctl --agent {AGENT} defrag --now` and read `pages_moved` in its output; if it "
        f"is 0 again, save `kvctl --agent {AGENT} pool map --json` for a bug report",
    ),
    (
        "KvctlDefragIneffective",
        dict(FRAGMENTED, last_defrag=defrag(0.6, 0.1, 90), last_defrag_age_seconds=300.0),
        "last defrag 5 min ago moved 90 pages (0.60 → 0.10), but requests ending at different "
        "times scatter free pages faster than defrag runs",
        "Let auto-defrag run sooner and more often, set `defrag.fragmentation_threshold=0.3` "
        "and `defrag.check_interval_s=2` (PATCH /v1/config)",
    ),
    (
        "KvctlPoolNearlyFull",
        dict(FULL, max_pool_pages=512, requests_waiting=3),
        "the pool is at its limit of 512 pages with 3 requests waiting",
        "Restart the agent with `--max-pool-pages 640` if the device has the memory; otherwise "
        "send fewer concurrent or shorter requests",
    ),
    (
        "KvctlPoolNearlyFull",
        dict(FULL, requests_waiting=3, requests_running=12),
        "12 running requests hold the pages, 3 more wait",
        f"Run `kvctl --agent {AGENT} pool resize --pages 640`; to grow on demand, set "
        "`resize.enabled=true` and `resize.high_water=0.85` (PATCH /v1/config)",
    ),
    (
        "KvctlPoolOverProvisioned",
        dict(used_pages=40, cached_pages=11, capacity_pages=512),
        "51 of 512 pages in use with 4 requests running",
        f"Run `kvctl --agent {AGENT} pool resize --pages 128`; to shrink automatically, set "
        "`resize.enabled=true` (PATCH /v1/config)",
    ),
    (
        "KvctlPoolOverProvisioned",
        dict(capacity_pages=64, used_pages=6, cached_pages=0),
        "the pool is a single segment of 64 pages and cannot shrink",
        "Nothing to shrink at run time; if the memory is needed elsewhere, restart the agent "
        "with `--pool-pages 64` and a smaller `--segment-pages`",
    ),
    (
        "KvctlPrefixHitRateLow",
        dict(FULL, prefix_hit_ratio=0.03, prefix_evictions_total=4096),
        "the pool is 97.07% full and the cache has evicted 4096 entries since start: prefixes are "
        "pushed out before they are reused",
        'Keep often reused prefixes: set `prefix_cache.eviction_policy="lfu"` (PATCH '
        f"/v1/config); or give the cache room: Run `kvctl --agent {AGENT} pool resize --pages "
        "640`; to grow on demand, set `resize.enabled=true` and `resize.high_water=0.85` "
        "(PATCH /v1/config)",
    ),
    (
        "KvctlPrefixHitRateLow",
        dict(prefix_hit_ratio=0.03),
        "6000 of 10000 prompt tokens looked up since start were found: requests share few "
        "prefixes, or clients send different `cache_salt` values",
        "Make shared prompt prefixes (system prompt, examples) byte-identical and keep one "
        "`cache_salt` per tenant; if requests never share prefixes, restart the agent with "
        "`--no-prefix-cache` to skip the lookups",
    ),
    (
        "KvctlPreemptionStorm",
        dict(FULL, preemptions_total=500, max_pool_pages=512, requests_waiting=9),
        "the pool is at its limit of 512 pages",
        "Restart the agent with `--max-pool-pages 640` if the device has the memory; otherwise "
        "send fewer concurrent or shorter requests",
    ),
    (
        "KvctlGpuMemoryNearCapacity",
        dict(gpus=gpu(78, split=10)),
        "torch's caching allocator holds 10.0 GiB in split blocks it cannot reuse",
        "Restart the agent with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in its "
        "environment; meanwhile give back spare pages with "
        f"`kvctl --agent {AGENT} pool resize --pages 320`",  # 256 in use + a tenth, in segments
    ),
    (
        "KvctlGpuMemoryNearCapacity",
        dict(gpus=gpu(78), used_pages=80, cached_pages=22),
        "the KV pool holds 32.0 MiB of the GPU's 80.0 GiB but only 19.92% of it is in use",
        f"Give memory back with `kvctl --agent {AGENT} pool resize --pages 256`",
    ),
    (
        "KvctlGpuMemoryNearCapacity",
        dict(gpus=gpu(78)),
        "the KV pool holds 32.0 MiB (50% in use); the model, activations and other processes "
        "hold 78.0 GiB",
        "Restart the agent with `--gpu-memory-fraction 0.8`, and check `nvidia-smi` for other "
        "processes on GPU 0",
    ),
    (
        "KvctlQueueStalled",
        dict(
            STALLED,
            used_pages=0,
            cached_pages=62,
            free_pages=2,
            capacity_pages=64,
            segment_pages=16,
            requests_waiting=256,
        ),
        "nothing runs while 62 cached prefix pages could be evicted to admit the head of the "
        "queue: the scheduler is not reclaiming the cache; the queue is full (256 of "
        "`--max-waiting` 256), so new requests are refused with 429",
        f"Admit the waiting requests with `kvctl --agent {AGENT} pool resize --pages 80`; save "
        f"`kvctl --agent {AGENT} pool show --json` and the agent's log for a bug report, then "
        "restart it: `systemctl restart kvctl-agent` (Kubernetes: delete the pod)",
    ),
    (
        "KvctlQueueStalled",
        dict(STALLED, used_pages=40, cached_pages=0, max_pool_pages=512),
        "nothing runs, yet 40 pages are held as if by running requests: pages of finished "
        "requests were not released",
        f"The pool may not grow: save `kvctl --agent {AGENT} pool show --json` and the agent's "
        "log for a bug report, then restart it: `systemctl restart kvctl-agent` (Kubernetes: "
        "delete the pod)",
    ),
    (
        "KvctlQueueStalled",
        dict(STALLED, requests_running=4),
        "4 requests are running but no step finished: the engine is stuck in a step (a hung "
        "device or kernel)",
        "Check `nvidia-smi` and the agent's log for a hung device or errors; save "
        f"`kvctl --agent {AGENT} pool show --json` and the agent's log for a bug report, then "
        "restart it: `systemctl restart kvctl-agent` (Kubernetes: delete the pod)",
    ),
    (
        "KvctlQueueStalled",
        dict(STALLED, used_pages=0, cached_pages=0, free_pages=512),
        "nothing runs and 512 of 512 pages are free: the engine is not admitting requests",
        f"Check the agent's log for errors; save `kvctl --agent {AGENT} pool show --json` and the "
        "agent's log for a bug report, then restart it: `systemctl restart kvctl-agent` "
        "(Kubernetes: delete the pod)",
    ),
    (
        "KvctlQueueWaitLong",
        dict(WAITING, requests_running=0, cached_pages=0, used_pages=0),
        "nothing runs although requests wait: the queue is stalled (KvctlQueueStalled fires "
        "after `alerts.queue_stalled_max_s`)",
        f"Admit the waiting requests with `kvctl --agent {AGENT} pool resize --pages 640`; save "
        f"`kvctl --agent {AGENT} pool show --json` and the agent's log for a bug report, then "
        "restart it: `systemctl restart kvctl-agent` (Kubernetes: delete the pod)",
    ),
    (
        "KvctlQueueWaitLong",
        {**WAITING, **FULL, "max_pool_pages": 512, "requests_running": 30},
        "the pool is at its limit of 512 pages and running requests hold 96.09% of the pool: "
        "waiting requests need room the pool may not grow to",
        "Restart the agent with `--max-pool-pages 640` if the device has the memory; otherwise "
        "send fewer concurrent or shorter requests",
    ),
    (
        "KvctlQueueWaitLong",
        dict(WAITING, requests_waiting=256, requests_running=30),
        "running requests hold 39.06% of the pool, so waiting requests are admitted only as "
        "running ones finish; the queue is full (256 of `--max-waiting` 256), so new requests "
        "are refused with 429",
        f"Run `kvctl --agent {AGENT} pool resize --pages 640`; to grow on demand, set "
        "`resize.enabled=true` and `resize.high_water=0.85` (PATCH /v1/config)",
    ),
    (
        "KvctlQueueWaitLong",
        dict(WAITING, requests_running=64),
        "64 requests run and running requests hold 39.06% of the pool: memory is not what holds "
        "the queue, the batch limit or the engine's speed is",
        "Send part of the traffic to other replicas of the model, or restart the agent with a "
        f"larger `--max-batch-seqs`; `kvctl --agent {AGENT} status` shows the queue",
    ),
]


@pytest.mark.parametrize(("name", "changes", "explanation", "remediation"), CASES)
def test_the_likely_cause_and_its_fix(
    name, changes, explanation, remediation, make_snapshot
) -> None:
    now = [T0]
    evaluator = AlertEvaluator(api.AlertSettings(for_s=0), "demo", "node-1:8477", lambda: now[0])
    evaluator.evaluate(make_snapshot())  # a minute of history, for the rates
    now[0] += 60
    alerts = {a.name: a for a in evaluator.evaluate(make_snapshot(**changes))}
    alert = alerts[name]
    assert alert.description.split("; ", 1)[1] == explanation
    assert alert.remediation == remediation


def test_the_brief_example_reads_as_written(make_snapshot) -> None:
    snapshot = make_snapshot(
        **FRAGMENTED,
        auto_defrag_enabled=False,
        last_defrag=defrag(0.7, 0.7, 0),
        last_defrag_age_seconds=14 * 60,
    )
    evaluator = AlertEvaluator(api.AlertSettings(for_s=0), "demo", "node-1:8477", lambda: T0)
    [alert] = evaluator.evaluate(snapshot)
    assert alert.description == (
        "fragmentation 0.71 with 212 free pages in 37 extents; "
        "last defrag 14 min ago moved 0 pages; auto-defrag is off"
    )


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(0, "0 s ago"), (89, "89 s ago"), (90, "2 min ago"), (840, "14 min ago"), (9000, "2.5 h ago")],
)
def test_ages(seconds, expected) -> None:
    assert text.ago(seconds) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.975, "97.5%"), (1.0, "100%"), (1 / 3, "33.33%"), (0.0, "0%"), (0.9999, "99.99%")],
)
def test_percentages_read_like_prometheus_humanize_percentage(value, expected) -> None:
    assert text.percent(value) == expected


def test_resize_suggestions_are_whole_segments_within_the_limit(make_snapshot) -> None:
    assert text.grow_target(make_snapshot()) == 640  # 512 × 1.25
    assert text.grow_target(make_snapshot(max_pool_pages=600)) == 600
    assert text.grow_target(make_snapshot(max_pool_pages=512)) is None
    assert text.shrink_target(make_snapshot(used_pages=40, cached_pages=11)) == 128  # 102 → 2 seg
    assert text.shrink_target(make_snapshot(used_pages=0, cached_pages=0)) == 64


def remedy(name: str, changes: dict, settings: api.RuntimeSettings, make_snapshot) -> str:
    """The remediation of alert `name` on a snapshot with `changes`, under `settings`."""
    evaluator = AlertEvaluator(settings, "demo", "node-1:8477", lambda: T0)
    alerts = {a.name: a for a in evaluator.evaluate(make_snapshot(**changes))}
    return alerts[name].remediation


def runtime(**sections: dict) -> api.RuntimeSettings:
    """Runtime settings with the given sections changed; alerts fire without `for`."""
    alerts = {"for_s": 0, **sections.pop("alerts", {})}
    return api.RuntimeSettings.model_validate({**sections, "alerts": alerts})


GROW = f"Run `kvctl --agent {AGENT} pool resize --pages 640`; "
SETTINGS_CASES = [
    # (alert, snapshot changes, settings in force, remediation)
    (
        "KvctlPoolNearlyFull",
        FULL,
        runtime(resize={"enabled": True, "high_water": 0.8}),
        GROW + "automatic resize is on and grows one segment once the pool stays above "
        "`resize.high_water=0.8` for `resize.window_s=60`",
    ),
    (
        "KvctlPoolNearlyFull",
        FULL,
        runtime(resize={"enabled": True}),
        GROW + "to grow on demand, set `resize.high_water=0.85` (PATCH /v1/config)",
    ),
    (
        "KvctlPoolNearlyFull",
        FULL,
        runtime(resize={"enabled": True, "high_water": 0.85, "max_pages": 512}),
        GROW + "to grow on demand, set `resize.max_pages=640` (PATCH /v1/config)",
    ),
    (
        "KvctlPoolOverProvisioned",
        dict(used_pages=40, cached_pages=11),
        runtime(resize={"enabled": True, "min_pages": 256}),
        f"Run `kvctl --agent {AGENT} pool resize --pages 128`; to shrink automatically, set "
        "`resize.min_pages=128` (PATCH /v1/config)",
    ),
    (
        "KvctlPoolOverProvisioned",
        dict(used_pages=40, cached_pages=11),
        runtime(resize={"enabled": True}),
        f"Run `kvctl --agent {AGENT} pool resize --pages 128`; automatic resize is on and "
        "shrinks one segment once the pool stays below `resize.low_water=0.3` for "
        "`resize.window_s=60`",
    ),
    (
        "KvctlPrefixHitRateLow",
        dict(FULL, prefix_hit_ratio=0.03, prefix_evictions_total=4096),
        runtime(prefix_cache={"eviction_policy": "lfu"}),
        "eviction already keeps the most reused prefixes (`lfu`); or give the cache room: "
        + GROW
        + "to grow on demand, set `resize.enabled=true` and `resize.high_water=0.85` "
        "(PATCH /v1/config)",
    ),
    (
        "KvctlFragmentationHigh",
        dict(FRAGMENTED, last_defrag=defrag(0.6, 0.02, 150), last_defrag_age_seconds=7200.0),
        runtime(defrag={"fragmentation_threshold": 0.3, "check_interval_s": 2.0}),
        f"Run `kvctl --agent {AGENT} defrag --now`; auto-defrag already checks every "
        "`defrag.check_interval_s=2` above "
        "`defrag.fragmentation_threshold=0.3`; a larger pool leaves more free room and "
        "scatters slower",
    ),
    (
        "KvctlFragmentationHigh",
        dict(FRAGMENTED, last_defrag=defrag(0.6, 0.02, 150), last_defrag_age_seconds=7200.0),
        runtime(defrag={"fragmentation_threshold": 0.3}),
        f"Run `kvctl --agent {AGENT} defrag --now`; to let auto-defrag act sooner, set "
        "`defrag.check_interval_s=2` (PATCH /v1/config)",
    ),
    (
        "KvctlFragmentationHigh",
        dict(FRAGMENTED, last_defrag=defrag(0.8, 0.6, 64, False), last_defrag_age_seconds=30.0),
        runtime(defrag={"step_max_pages": 256}),
        f"Run `kvctl --agent {AGENT} defrag --now` for a full pass; so runs finish, set "
        "`defrag.step_max_seconds=0.01` (PATCH /v1/config)",
    ),
]


@pytest.mark.parametrize(("name", "changes", "settings", "expected"), SETTINGS_CASES)
def test_remedies_read_the_settings_in_force(
    name, changes, settings, expected, make_snapshot
) -> None:
    assert remedy(name, changes, settings, make_snapshot) == expected


def test_no_remedy_suggests_a_setting_already_in_force(make_snapshot) -> None:
    """Every alert's remedy, under settings that already hold every value a remedy suggests."""
    settled = runtime(
        resize={"enabled": True, "high_water": 0.85},
        defrag={"fragmentation_threshold": 0.3, "check_interval_s": 2.0, "step_max_pages": 256},
        prefix_cache={"eviction_policy": "lfu"},
    )
    states = [
        dict(FULL, requests_waiting=3),
        dict(FAILING, requests_waiting=6),
        dict(FULL, prefix_hit_ratio=0.03, prefix_evictions_total=4096),
        dict(FRAGMENTED, last_defrag=defrag(0.6, 0.02, 150), last_defrag_age_seconds=60.0),
        dict(FRAGMENTED, last_defrag=defrag(0.8, 0.6, 64, False), last_defrag_age_seconds=30.0),
        dict(used_pages=40, cached_pages=11),
        dict(WAITING, requests_waiting=256, requests_running=30),
    ]
    in_force = [
        "`resize.enabled=true`",
        "`resize.high_water=0.85`",
        "`defrag.fragmentation_threshold=0.3`",
        "`defrag.check_interval_s=2`",
        "`defrag.step_max_pages=256`",
        '`prefix_cache.eviction_policy="lfu"`',
    ]
    for changes in states:
        evaluator = AlertEvaluator(settled, "demo", "node-1:8477", lambda: T0)
        alerts = evaluator.evaluate(make_snapshot(**changes))
        assert alerts, changes
        for alert in alerts:
            for setting in in_force:
                assert f"set {setting}" not in alert.remediation, (alert.name, changes)
                assert f"and {setting}" not in alert.remediation, (alert.name, changes)
