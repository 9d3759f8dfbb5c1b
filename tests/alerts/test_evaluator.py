"""AlertEvaluator: pending → firing after `for`, hysteresis on the way out, rates over its own
history, one alert per GPU, all on an injected clock."""

from __future__ import annotations

import pytest

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
        alerts = ev.evaluate(make_snapshot(fragmentation_ratio=value))
        assert states(alerts).get("KvctlFragmentationHigh") == expected, (clock.now - T0, value)
        clock.now += 15
    [alert] = ev.alerts
    assert alert.active_since == T0 + 135


def test_a_pending_alert_needs_the_trigger_all_along(clock, make_snapshot) -> None:
    ev = evaluator(clock, for_s=60)
    ev.evaluate(make_snapshot(fragmentation_ratio=0.6))
    clock.now += 15
    assert ev.evaluate(make_snapshot(fragmentation_ratio=0.45)) == []
    clock.now += 15
    [alert] = ev.evaluate(make_snapshot(fragmentation_ratio=0.6))
    assert alert.state == "pending" and alert.active_since == T0 + 30


def test_for_zero_fires_at_once_and_a_missing_value_clears(clock, make_snapshot) -> None:
    ev = evaluator(clock, for_s=0)
    [alert] = ev.evaluate(make_snapshot(alloc_success_ratio=0.99, alloc_failures_total=3))
    assert (alert.name, alert.state, alert.value) == ("KvctlAllocationFailures", "firing", 0.99)
    assert ev.evaluate(make_snapshot(alloc_success_ratio=None)) == []  # nothing allocated lately


def test_longer_for_of_slow_alerts_scales_with_alert_for(clock, make_snapshot) -> None:
    ev = evaluator(clock, for_s=60)
    idle = make_snapshot(utilization_ratio=0.1, used_pages=40, cached_pages=11, free_pages=461)
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
    ev = evaluator(clock, for_s=0)
    assert states(ev.evaluate(make_snapshot(fragmentation_ratio=0.6))) == {
        "KvctlFragmentationHigh": "firing"
    }
    ev.settings = api.AlertSettings(for_s=0, fragmentation_max=0.8)  # clear level now 0.7
    assert ev.evaluate(make_snapshot(fragmentation_ratio=0.6)) == []


def test_labels_runbook_and_order(clock, make_snapshot) -> None:
    ev = AlertEvaluator(
        api.AlertSettings(for_s=0),
        "llama-8b",
        "gpu-node-3:8477",
        clock,
        runbook_base="https://runbooks.example/kvctl/alerts.md",
    )
    alerts = ev.evaluate(
        make_snapshot(fragmentation_ratio=0.7, alloc_success_ratio=0.9, prefix_hit_ratio=0.01)
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
    }
    assert alerts[1].runbook_url == (
        "https://runbooks.example/kvctl/alerts.md#kvctlfragmentationhigh"
    )
    assert alerts[1].summary == "KV pool llama-8b at gpu-node-3:8477 is fragmented"
    assert "`kvctl --agent http://gpu-node-3:8477 defrag --now`" in alerts[1].remediation


TRIGGERS = {
    "KvctlAllocationFailures": dict(alloc_success_ratio=0.98, alloc_failures_total=20),
    "KvctlFragmentationHigh": dict(fragmentation_ratio=0.7),
    "KvctlDefragIneffective": dict(
        fragmentation_ratio=0.7,
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
    "KvctlPoolNearlyFull": dict(utilization_ratio=0.97, used_pages=480, free_pages=16),
    "KvctlPoolOverProvisioned": dict(utilization_ratio=0.1),
    "KvctlPrefixHitRateLow": dict(prefix_hit_ratio=0.02),
    "KvctlPreemptionStorm": dict(preemptions_total=1000),
    "KvctlGpuMemoryNearCapacity": dict(
        gpus=[api.GpuMemory(index=0, name="L4", used_bytes=23 << 30, total_bytes=24 << 30)]
    ),
}


@pytest.mark.parametrize("definition", DEFINITIONS, ids=lambda d: d.name)
def test_every_alert_fires_with_a_value_a_cause_and_a_command(
    definition, clock, make_snapshot
) -> None:
    ev = evaluator(clock, for_s=0)
    ev.evaluate(make_snapshot())
    clock.now += 60
    alerts = {a.name: a for a in ev.evaluate(make_snapshot(**TRIGGERS[definition.name]))}
    alert = alerts[definition.name]
    assert alert.state == "firing"
    assert "; " not in definition.headline  # "; " separates the headline from the cause
    headline, cause = alert.description.split("; ", 1)
    assert headline and cause
    assert "`" in alert.remediation  # a command, setting or flag to paste
    assert alert.runbook_url == f"docs/alerts.md#{definition.name.lower()}"
