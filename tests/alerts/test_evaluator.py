"""AlertEvaluator: pending → firing after `for`, hysteresis on the way out, rates over its own
history with a minimum count, severities that escalate and come back, one alert per GPU, the
identity labels, all on an injected clock."""

from __future__ import annotations

import pytest
from pool_readings import tier_reading

from kvctl import api
from kvctl.alerts import DEFINITIONS, AlertEvaluator
from kvctl.alerts.evaluator import CounterRate

T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def evaluator(clock: Clock, **settings) -> AlertEvaluator:
    return AlertEvaluator(api.AlertSettings(**settings), "demo", "node-1:8477", clock)


def states(alerts: list[api.Alert]) -> dict[str, str]:
    return {a.name: a.state for a in alerts}


def test_a_healthy_pool_raises_nothing(clock, make_snapshot) -> None:
    assert evaluator(clock, for_s=0).evaluate(make_snapshot()) == []


def test_pending_until_for_then_firing_then_held_down_to_the_clear_level(
    clock, make_snapshot
) -> None:
    ev = evaluator(clock, for_s=60)
    # fragmentation over 15 s evaluations; trigger 0.5, clear 0.4
    timeline = [
        (0.55, "pending"),
        (0.60, "pending"),
        (0.60, "pending"),
        (0.60, "pending"),
        (0.60, "firing"),  # 60 s after it became active
        (0.45, "firing"),  # below the trigger, above the clear level: still firing
        (0.41, "firing"),
        (0.39, None),  # past the clear level: resolved
        (0.45, None),  # not past the trigger again
        (0.51, "pending"),
    ]
    for value, expected in timeline:
        alerts = ev.evaluate(make_snapshot(fragmentation=value))
        assert states(alerts).get("KvctlFragmentationHigh") == expected, (clock.now - T0, value)
        clock.now += 15
    [alert] = ev.alerts
    assert alert.active_since == T0 + 135


def test_a_pending_alert_needs_the_trigger_all_along(clock, make_snapshot) -> None:
    ev = evaluator(clock, for_s=60)
    ev.evaluate(make_snapshot(fragmentation=0.6))
    clock.now += 15
    assert ev.evaluate(make_snapshot(fragmentation=0.45)) == []
    clock.now += 15
    [alert] = ev.evaluate(make_snapshot(fragmentation=0.6))
    assert alert.state == "pending" and alert.active_since == T0 + 30


def test_for_zero_fires_at_once_and_a_missing_value_clears(clock, make_snapshot) -> None:
    ev = evaluator(clock, for_s=0)
    [alert] = ev.evaluate(make_snapshot(window_alloc_attempts=1000, window_alloc_failures=10))
    assert (alert.name, alert.state, alert.value) == ("KvctlAllocationFailures", "firing", 0.99)
    nothing = make_snapshot(window_alloc_attempts=0, window_alloc_failures=0)
    assert ev.evaluate(nothing) == []  # nothing allocated lately


def allocations(attempts: int, failures: int, **changes: object) -> dict:
    return dict(window_alloc_attempts=attempts, window_alloc_failures=failures, **changes)


def test_allocation_failures_need_a_count_and_a_rate_to_page(clock, make_snapshot) -> None:
    """Warning from 5 failures in the window, critical from a 5% failure share over at least
    100 attempts; critical holds down to 4%, the warning down to one failure left."""
    ev = evaluator(clock, for_s=0)
    timeline = [
        (allocations(400, 1), None),  # one failure is not an alert
        (allocations(400, 4), None),
        (allocations(400, 5), "warning"),
        (allocations(400, 19), "warning"),  # 4.75%: under the critical share
        (allocations(50, 10), "warning"),  # 20%, but too few attempts to tell a rate
        (allocations(400, 20), "critical"),  # 5% of 400
        (allocations(400, 17), "critical"),  # 4.25%: held down to 4%
        (allocations(400, 15), "warning"),  # 3.75%
        (allocations(400, 2), "warning"),  # under the minimum, but failures are left
        (allocations(400, 0), None),  # the window is clean: resolved
        (allocations(400, 3), None),  # not the minimum again
    ]
    for changes, expected in timeline:
        alerts = {a.name: a for a in ev.evaluate(make_snapshot(**changes))}
        alert = alerts.get("KvctlAllocationFailures")
        assert (alert and alert.severity) == expected, changes
        if alert:
            assert alert.labels["severity"] == alert.severity
        clock.now += 15


def test_a_severity_change_keeps_the_alert_active_since_its_start(clock, make_snapshot) -> None:
    ev = evaluator(clock, for_s=30)
    ev.evaluate(make_snapshot(**allocations(400, 8)))
    clock.now += 30
    [warning] = ev.evaluate(make_snapshot(**allocations(400, 8)))
    clock.now += 15
    [critical] = ev.evaluate(make_snapshot(**allocations(400, 40)))
    assert (warning.state, warning.severity) == ("firing", "warning")
    assert (critical.state, critical.severity) == ("firing", "critical")  # no second `for`
    assert critical.active_since == warning.active_since == T0
    assert critical.description.startswith(
        "90% of the 400 page allocations of the last 5 min succeeded (40 failed); "
    )


def test_a_full_prefix_cache_is_not_pressure(clock, make_snapshot) -> None:
    """An idle pool full of cached prefix pages can admit at once: they are evicted on demand."""
    idle = make_snapshot(
        used_pages=0,
        cached_pages=500,
        free_pages=12,
        requests_running=0,
        window_alloc_attempts=0,
    )
    assert evaluator(clock, for_s=0).evaluate(idle) == []
    busy = make_snapshot(
        used_pages=497,
        cached_pages=3,
        free_pages=12,
    )
    [alert] = evaluator(clock, for_s=0).evaluate(busy)
    assert alert.name == "KvctlPoolNearlyFull"
    assert alert.description.startswith(
        "running requests hold 97.07% of the pool: 497 of 512 pages (3 more are cached and "
        "reclaimable); "
    )


def test_a_threshold_no_value_can_cross_turns_its_alert_off(clock, make_snapshot) -> None:
    idle = make_snapshot(used_pages=0, cached_pages=0, free_pages=512)
    ev = evaluator(clock, for_s=0, utilization_low=0.5)
    assert states(ev.evaluate(idle)) == {"KvctlPoolOverProvisioned": "firing"}
    ev.settings = api.AlertSettings(for_s=0, utilization_low=0.0)  # 0 is below nothing: off
    assert ev.evaluate(idle) == []
    ev.settings = api.AlertSettings(for_s=0, utilization_low=0.5)
    assert states(ev.evaluate(idle)) == {"KvctlPoolOverProvisioned": "firing"}
    clock.now += 15
    full = make_snapshot(fragmentation=0.9)
    assert "KvctlFragmentationHigh" in states(evaluator(clock, for_s=0).evaluate(full))
    assert evaluator(clock, for_s=0, fragmentation_max=1.0).evaluate(full) == []


def test_a_stalled_queue_and_a_long_wait_fire_and_resolve_when_it_moves(
    clock, make_snapshot
) -> None:
    ev = evaluator(clock, for_s=60)  # both measure a duration already: no extra `for`
    stuck = dict(requests_waiting=8, requests_running=0, used_pages=0, cached_pages=62)
    assert ev.evaluate(make_snapshot(**stuck, queue_stalled_seconds=25.0)) == []
    alerts = ev.evaluate(
        make_snapshot(**stuck, queue_stalled_seconds=31.0, oldest_waiting_seconds=61.0)
    )
    assert [(a.name, a.severity, a.state) for a in alerts] == [
        ("KvctlQueueStalled", "critical", "firing"),
        ("KvctlQueueWaitLong", "warning", "firing"),
    ]
    assert alerts[0].description.startswith(
        "8 requests have waited 31 s with no token produced and none admitted or refused "
        "(0 running); nothing runs while 62 cached prefix pages could be evicted"
    )
    # the queue moved once but not for long: held above the clear levels (15 s and 30 s)
    held = ev.evaluate(
        make_snapshot(**stuck, queue_stalled_seconds=16.0, oldest_waiting_seconds=31.0)
    )
    assert len(held) == 2
    moving = dict(requests_waiting=2, requests_running=6, queue_stalled_seconds=0.0)
    assert ev.evaluate(make_snapshot(**moving, oldest_waiting_seconds=4.0)) == []


def test_longer_for_of_slow_alerts_scales_with_alert_for(clock, make_snapshot) -> None:
    ev = evaluator(clock, for_s=60)
    idle = make_snapshot(used_pages=40, cached_pages=11, free_pages=461)
    ev.evaluate(idle)
    clock.now += 29 * 60
    assert states(ev.evaluate(idle)) == {"KvctlPoolOverProvisioned": "pending"}
    clock.now += 60
    assert states(ev.evaluate(idle)) == {"KvctlPoolOverProvisioned": "firing"}


def test_preemptions_per_minute_come_from_the_counter_history(clock, make_snapshot) -> None:
    ev = evaluator(clock, for_s=0)
    total = 0
    for per_minute, expected in [(0, None), (40, "firing"), (40, "firing"), (25, "firing")]:
        total += per_minute // 4  # 15 s of that rate
        alerts = ev.evaluate(make_snapshot(preemptions_total=total))
        assert states(alerts).get("KvctlPreemptionStorm") == expected, per_minute
        clock.now += 15
    # 25/min held the alert (clear level 24); the five-minute average decides from here on
    for _ in range(25):
        total += 5  # 20/min
        alerts = ev.evaluate(make_snapshot(preemptions_total=total))
        clock.now += 15
    assert "KvctlPreemptionStorm" not in states(alerts)


def test_counter_rate_covers_its_window_and_survives_a_restart() -> None:
    rate = CounterRate(window_s=300)
    assert rate.update(0, 0) is None
    assert rate.update(60, 30) == pytest.approx(30)
    for t in range(120, 601, 60):
        rate.update(t, 30)
    assert rate.update(660, 30) == 0  # the burst is out of the window
    assert rate.update(720, 3) is None  # the counter went back: history restarts


def test_one_alert_per_gpu_that_is_nearly_full(clock, make_snapshot) -> None:
    gib = 1 << 30
    gpus = [
        api.GpuMemory(index=0, name="H100", used_bytes=40 * gib, total_bytes=80 * gib),
        api.GpuMemory(index=1, name="H100", used_bytes=79 * gib, total_bytes=80 * gib),
    ]
    [alert] = evaluator(clock, for_s=0).evaluate(make_snapshot(gpus=gpus))
    assert alert.name == "KvctlGpuMemoryNearCapacity"
    assert alert.labels["gpu"] == "1"
    assert alert.description.startswith("GPU 1 memory 98.75% used; ")


def test_changed_settings_apply_at_the_next_evaluation(clock, make_snapshot) -> None:
    """Thresholds alone or the whole runtime settings: both are what the agent has in force."""
    ev = evaluator(clock, for_s=0)
    assert states(ev.evaluate(make_snapshot(fragmentation=0.6))) == {
        "KvctlFragmentationHigh": "firing"
    }
    ev.settings = api.RuntimeSettings(alerts=api.AlertSettings(for_s=0, fragmentation_max=0.8))
    assert ev.evaluate(make_snapshot(fragmentation=0.6)) == []  # clear level now 0.7


def test_labels_are_what_prometheus_would_attach_and_links_are_absolute(
    clock, make_snapshot
) -> None:
    ev = AlertEvaluator(
        api.AlertSettings(for_s=0),
        "llama-8b",
        "gpu-node-3:8477",
        clock,
        agent_url="https://gpu-node-3:8477",
        job="llm-kv",
    )
    alerts = ev.evaluate(
        make_snapshot(fragmentation=0.7, prefix_hit_ratio=0.01, **allocations(400, 40))
    )
    assert [a.name for a in alerts] == [
        "KvctlAllocationFailures",  # critical first
        "KvctlFragmentationHigh",
        "KvctlPrefixHitRateLow",
    ]
    assert alerts[1].labels == {
        "alertname": "KvctlFragmentationHigh",
        "severity": "warning",
        "pool": "llama-8b",
        "instance": "gpu-node-3:8477",
        "job": "llm-kv",
    }
    assert alerts[1].runbook_url == "https://gpu-node-3:8477/runbook#kvctlfragmentationhigh"
    assert alerts[1].summary == "KV pool llama-8b at gpu-node-3:8477 is fragmented"
    assert "`kvctl --agent https://gpu-node-3:8477 defrag --now`" in alerts[1].remediation


def test_a_runbook_base_replaces_the_agents_own(clock, make_snapshot) -> None:
    ev = AlertEvaluator(
        api.AlertSettings(for_s=0),
        "demo",
        "node-1:8477",
        clock,
        runbook_base="https://wiki.example.com/kvctl/alerts/",
    )
    [alert] = ev.evaluate(make_snapshot(fragmentation=0.7))
    assert alert.runbook_url == "https://wiki.example.com/kvctl/alerts#kvctlfragmentationhigh"
    assert alert.labels["job"] == "kvctl-agent"  # the default scrape job


TRIGGERS = {
    "KvctlAllocationFailures": dict(window_alloc_attempts=1000, window_alloc_failures=20),
    "KvctlQueueStalled": dict(requests_waiting=3, queue_stalled_seconds=45.0),
    "KvctlQueueWaitLong": dict(requests_waiting=3, oldest_waiting_seconds=75.0),
    "KvctlFragmentationHigh": dict(fragmentation=0.7),
    "KvctlDefragIneffective": dict(
        fragmentation=0.7,
        last_defrag_age_seconds=120.0,
        last_defrag=api.DefragResult(
            trigger="threshold",
            fragmentation_before=0.72,
            fragmentation_after=0.7,
            free_extents_before=40,
            free_extents_after=38,
            pages_moved=3,
            bytes_moved=3 * 65536,
            seconds=0.01,
            complete=True,
        ),
    ),
    "KvctlPoolNearlyFull": dict(used_pages=497, cached_pages=0),
    "KvctlPoolOverProvisioned": dict(used_pages=40, cached_pages=11),
    "KvctlKvBudgetExhausted": dict(
        requests_waiting=4,
        share=api.PoolShare(
            budget_bytes=64 << 20,
            assigned_bytes=64 << 20,
            floor_pages=64,
            ceiling_pages=1024,
            under_pressure=True,
            short_pages=20,
            pools_total=2,
            pools_under_pressure=2,
        ),
    ),
    "KvctlPrefixHitRateLow": dict(prefix_hit_ratio=0.02),
    "KvctlPrefixPinsCrowdPool": dict(prefix_pins=2, prefix_pinned_pages=300, requests_waiting=4),
    "KvctlPreemptionStorm": dict(preemptions_total=1000),
    "KvctlGpuMemoryNearCapacity": dict(
        gpus=[api.GpuMemory(index=0, name="L4", used_bytes=23 << 30, total_bytes=24 << 30)]
    ),
    # tier alerts read counters over the window: the first snapshot (BEFORE) starts the history
    "KvctlTierStoresUnused": dict(tiers=[tier_reading("host", stored_pages_total=500)]),
    "KvctlTierLoadsSlowerThanPrefill": dict(
        prefill_seconds_per_token=0.0004,
        tiers=[
            tier_reading(
                "host", loaded_pages_total=100, hits_tokens_total=1600, load_seconds_total=2.0
            )
        ],
    ),
    "KvctlTierStoreFailures": dict(
        tiers=[tier_reading("disk", store_failures_total={"full": 0, "io": 12})]
    ),
    "KvctlDiskTierFilesystemFull": dict(
        tiers=[tier_reading("disk", capacity_pages=20_000_000, filesystem_free_bytes=100 << 30)]
    ),
}
BEFORE = {name: dict(tiers=[tier_reading("host")]) for name in TRIGGERS if "Tier" in name}
BEFORE["KvctlTierStoreFailures"] = dict(tiers=[tier_reading("disk")])


@pytest.mark.parametrize("definition", DEFINITIONS, ids=lambda d: d.name)
def test_every_alert_fires_with_a_value_a_cause_and_a_command(
    definition, clock, make_snapshot
) -> None:
    ev = evaluator(clock, for_s=0)
    ev.evaluate(make_snapshot(**BEFORE.get(definition.name, {})))
    clock.now += 60
    alerts = {a.name: a for a in ev.evaluate(make_snapshot(**TRIGGERS[definition.name]))}
    alert = alerts[definition.name]
    assert alert.state == "firing"
    assert "; " not in definition.headline  # "; " separates the headline from the cause
    headline, cause = alert.description.split("; ", 1)
    assert headline and cause
    assert "`" in alert.remediation  # a command, setting or flag to paste
    assert alert.runbook_url == f"http://node-1:8477/runbook#{definition.name.lower()}"
    assert (alert.labels["job"], alert.labels["instance"]) == ("kvctl-agent", "node-1:8477")


def test_a_pool_with_waiting_requests_is_never_over_provisioned(clock, make_snapshot) -> None:
    """Advising a shrink while requests queue would make the wait longer."""
    nearly_empty = dict(used_pages=10, cached_pages=0)
    ev = evaluator(clock, for_s=0)
    assert states(ev.evaluate(make_snapshot(**nearly_empty))) == {
        "KvctlPoolOverProvisioned": "firing"
    }
    assert ev.evaluate(make_snapshot(**nearly_empty, requests_waiting=3)) == []


IDLE = dict(used_pages=0, cached_pages=0, requests_running=0, window_alloc_attempts=0)
"""A pool no request was given pages in the stats window: just started, or drained."""
SERVING = dict(
    used_pages=8,
    cached_pages=4,
    requests_running=1,
    window_alloc_attempts=12,
    requests_finished_total={"stop": 30},
)
"""A pool serving a trickle of requests on 12 of its 512 pages."""


def test_an_idle_pool_is_never_over_provisioned(clock, make_snapshot) -> None:
    """A pool without traffic says nothing about the size its traffic needs, however long it
    stays idle, even with no `for` at all."""
    for for_s in (60, 0):
        ev = evaluator(clock, for_s=for_s)
        for _ in range(4 * 60 * 3):  # three hours of 15 s evaluations
            assert ev.evaluate(make_snapshot(**IDLE)) == []
            clock.now += 15


def test_over_provisioned_counts_only_the_time_the_pool_serves(clock, make_snapshot) -> None:
    """Pending from the first evaluation with traffic, firing after 30 x alert-for of it; once
    the traffic stops there is nothing left to judge, and the count starts again after."""
    ev = evaluator(clock, for_s=60)
    assert ev.evaluate(make_snapshot(**IDLE)) == []
    clock.now += 3600
    assert ev.evaluate(make_snapshot(**IDLE)) == []
    assert states(ev.evaluate(make_snapshot(**SERVING))) == {"KvctlPoolOverProvisioned": "pending"}
    clock.now += 29 * 60
    assert states(ev.evaluate(make_snapshot(**SERVING))) == {"KvctlPoolOverProvisioned": "pending"}
    clock.now += 60
    [alert] = ev.evaluate(make_snapshot(**SERVING))
    assert (alert.name, alert.state) == ("KvctlPoolOverProvisioned", "firing")
    assert alert.value == 12 / 512
    clock.now += 15
    assert ev.evaluate(make_snapshot(**IDLE)) == []
    clock.now += 15
    assert states(ev.evaluate(make_snapshot(**SERVING))) == {"KvctlPoolOverProvisioned": "pending"}


def test_a_sleeping_pool_is_never_over_provisioned(clock, make_snapshot) -> None:
    """Asleep, the pool holds nothing (capacity 0) while the stats window still counts the
    allocations it made awake: an empty pool, not a pool too large."""
    asleep = dict(
        used_pages=0,
        cached_pages=0,
        capacity_pages=0,
        free_pages=0,
        largest_free_run=0,
        free_extents=0,
        requests_running=0,
        window_alloc_attempts=12,
        sleep=api.SleepReading(state="asleep", level=1, asleep_seconds=60.0),
    )
    ev = evaluator(clock, for_s=0)
    assert ev.evaluate(make_snapshot(**asleep)) == []
    awake = {
        **asleep,
        "sleep": api.SleepReading(),
        "capacity_pages": 512,
        "free_pages": 512,
        "largest_free_run": 512,
        "free_extents": 1,
    }
    assert states(ev.evaluate(make_snapshot(**awake))) == {"KvctlPoolOverProvisioned": "firing"}
