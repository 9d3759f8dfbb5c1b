"""The /metrics exposition: every series of the table, exactly, read back with Prometheus' parser.

Each test renders a registry built from a hand-made snapshot (every field a different number, so
a getter reading the wrong field shows up) and compares the parsed samples with the values
written out here.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from metric_samples import Samples, kvctl_samples
from pool_readings import pool_snapshot, tier_reading
from prometheus_client.parser import text_string_to_metric_families
from promised_metrics import PROMISED_METRICS

from kvctl import __version__
from kvctl.agent.observe.metrics import (
    DEFRAG_DURATION_BUCKETS,
    INTER_TOKEN_BUCKETS,
    METRICS,
    QUEUE_BUCKETS,
    REQUEST_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    WAKE_BUCKETS,
    DurationHistogram,
    Histograms,
    build_registry,
    render,
)
from kvctl.agent.observe.metrics_docs import metrics_markdown
from kvctl.agent.prefix.residency import RESIDENCY_BUCKETS
from kvctl.api import Alert, GpuMemory, PoolShare, PoolSnapshot, SleepReading, TierReading

ROOT = Path(__file__).resolve().parents[2]


def host_tier(**changes: Any) -> TierReading:
    fields: dict[str, Any] = dict(
        capacity_pages=2048,
        used_pages=1500,
        page_bytes=4096,
        hits_tokens_total=2400,
        stored_pages_total=5000,
        stored_bytes_total=20_480_000,
        loaded_pages_total=150,
        loaded_bytes_total=614_400,
        store_seconds_total=1.25,
        load_seconds_total=0.5,
        evicted_pages_total=3100,
        store_failures_total={"full": 4, "io": 0},
    )
    return tier_reading("host", **{**fields, **changes})


def disk_tier(**changes: Any) -> TierReading:
    fields: dict[str, Any] = dict(
        capacity_pages=10_000,
        used_pages=3000,
        page_bytes=4144,
        hits_tokens_total=640,
        stored_pages_total=3100,
        stored_bytes_total=12_697_600,
        loaded_pages_total=40,
        loaded_bytes_total=163_840,
        store_seconds_total=6.5,
        load_seconds_total=2.0,
        evicted_pages_total=100,
        store_failures_total={"full": 0, "io": 7},
        load_failures_total={"missing": 1, "truncated": 2, "checksum": 3, "io": 0},
        path="/var/lib/kvctl/tier",
        filesystem_free_bytes=50_000_000_000,
        filesystem_size_bytes=1_000_000_000_000,
    )
    return tier_reading("disk", **{**fields, **changes})


def make_snapshot(**overrides: Any) -> PoolSnapshot:
    fields: dict[str, Any] = dict(
        pool="llama-3-8b",
        timestamp=1_700_000_000.0,
        device="cpu",
        page_size=16,
        bytes_per_page=4096,
        segment_pages=256,
        segments=4,
        capacity_pages=1024,
        used_pages=600,
        cached_pages=100,
        free_pages=324,
        free_extents=7,
        largest_free_run=243,
        reserved_pages=17,
        prompt_tokens_total=5000,
        generation_tokens_total=1200,
        max_pool_pages=2048,
        alloc_attempts_total=1000,
        alloc_failures_total=3,
        alloc_success_ratio=0.99,
        window_seconds=300.0,
        prefix_cache_enabled=True,
        prefix_queries_tokens_total=50_000,
        prefix_hits_tokens_total=12_000,
        prefix_hit_ratio=0.2,
        prefix_evictions_total=11,
        prefix_hits_tokens_by_tier={"device": 8960, "host": 2400, "disk": 640},
        tiers=[host_tier(), disk_tier()],
        prefill_seconds_per_token=0.0004,
        defrag_runs_total={"manual": 2, "threshold": 5},
        defrag_pages_moved_total=321,
        defrag_active=False,
        last_defrag=None,
        last_defrag_age_seconds=None,
        auto_defrag_enabled=True,
        resizes_total={"grow": 1},
        requests_running=9,
        requests_waiting=13,
        preemptions_total=17,
        page_groups=7,
        window_pages=120,
        window_released_pages_total=4500,
        prefix_pins=2,
        prefix_pinned_pages=40,
        prefix_pin_cap_pages=256,
        token_slots_used=8192,
        preemptions_by_reason_total={"growth": 15, "shrink": 2},
        prefix_evictions_by_reason_total={"allocation": 9, "shrink": 2},
        sleep=SleepReading(
            state="waking",
            level=2,
            asleep_seconds=30.0,
            released_bytes=3 * 2**20,
            weights_released_bytes=2**30,
            sleeps_total={"manual": 1},
            wakes_total={"request": 3},
        ),
        alert_notifications_dropped_total=2,
        gpus=[
            GpuMemory(index=0, name="H200", used_bytes=70 * 2**30, total_bytes=141 * 2**30),
            GpuMemory(index=1, name="H200", used_bytes=5 * 2**30, total_bytes=141 * 2**30),
        ],
        max_waiting=256,
        oldest_waiting_seconds=4.5,
        queue_stalled_seconds=1.5,
        window_alloc_attempts=300,
        window_alloc_failures=3,
        requests_finished_total={"stop": 40, "length": 60, "abort": 2},
        requests_rejected_total={"queue_full": 7, "too_large": 1},
        admin_actions_total={"resize": 1, "config": 2},
        share=PoolShare(
            budget_bytes=8 * 2**20,
            assigned_bytes=6 * 2**20,
            floor_pages=256,
            ceiling_pages=2048,
            pinned=True,
            under_pressure=True,
            short_pages=40,
            reclaimable_pages=0,
            pools_total=2,
            pools_under_pressure=1,
            rebalances_total={"in": 3},
            rebalanced_bytes_total={"in": 3 * 2**20},
        ),
    )
    fields.update(overrides)
    return pool_snapshot(**fields)


def firing_alert(**labels: str) -> Alert:
    return Alert(
        name="KvctlPoolNearlyFull",
        severity="critical",
        state="firing",
        value=0.97,
        summary="",
        description="",
        remediation="",
        runbook_url="",
        active_since=1_700_000_000.0,
        labels={"alertname": "KvctlPoolNearlyFull", "pool": "llama-3-8b", **labels},
    )


@dataclass
class KvEventCounts:
    """The counters of a KV-events publisher."""

    published_batches: int = 900
    dropped_batches: int = 4
    dropped_events: int = 37
    ignored_replay_requests: int = 12


def scrape(snapshot: PoolSnapshot, durations: DurationHistogram | None = None) -> str:
    histograms = Histograms() if durations is None else Histograms(defrag=durations)
    registry = build_registry(
        lambda: snapshot, histograms, lambda: [firing_alert()], lambda: KvEventCounts()
    )
    body, content_type = render(registry)
    assert content_type.startswith("text/plain; version=0.0.4")
    return body.decode()


def series(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset({"pool": "llama-3-8b", **labels}.items())


GIB = 2**30


TIER_SERIES: Samples = {
    series("kvctl_kv_tier_capacity_bytes", tier="host"): 2048 * 4096,
    series("kvctl_kv_tier_capacity_bytes", tier="disk"): 10_000 * 4144,
    series("kvctl_kv_tier_used_bytes", tier="host"): 1500 * 4096,
    series("kvctl_kv_tier_used_bytes", tier="disk"): 3000 * 4144,
    series("kvctl_kv_tier_stored_pages_total", tier="host"): 5000,
    series("kvctl_kv_tier_stored_pages_total", tier="disk"): 3100,
    series("kvctl_kv_tier_stored_bytes_total", tier="host"): 20_480_000,
    series("kvctl_kv_tier_stored_bytes_total", tier="disk"): 12_697_600,
    series("kvctl_kv_tier_loaded_pages_total", tier="host"): 150,
    series("kvctl_kv_tier_loaded_pages_total", tier="disk"): 40,
    series("kvctl_kv_tier_loaded_bytes_total", tier="host"): 614_400,
    series("kvctl_kv_tier_loaded_bytes_total", tier="disk"): 163_840,
    series("kvctl_kv_tier_store_seconds_total", tier="host"): 1.25,
    series("kvctl_kv_tier_store_seconds_total", tier="disk"): 6.5,
    series("kvctl_kv_tier_load_seconds_total", tier="host"): 0.5,
    series("kvctl_kv_tier_load_seconds_total", tier="disk"): 2.0,
    series("kvctl_kv_tier_evicted_pages_total", tier="host"): 3100,
    series("kvctl_kv_tier_evicted_pages_total", tier="disk"): 100,
    series("kvctl_kv_tier_store_failures_total", tier="host", reason="full"): 4,
    series("kvctl_kv_tier_store_failures_total", tier="host", reason="io"): 0,
    series("kvctl_kv_tier_store_failures_total", tier="disk", reason="full"): 0,
    series("kvctl_kv_tier_store_failures_total", tier="disk", reason="io"): 7,
    series("kvctl_kv_tier_load_failures_total", tier="host", reason="missing"): 0,
    series("kvctl_kv_tier_load_failures_total", tier="host", reason="truncated"): 0,
    series("kvctl_kv_tier_load_failures_total", tier="host", reason="checksum"): 0,
    series("kvctl_kv_tier_load_failures_total", tier="host", reason="io"): 0,
    series("kvctl_kv_tier_load_failures_total", tier="disk", reason="missing"): 1,
    series("kvctl_kv_tier_load_failures_total", tier="disk", reason="truncated"): 2,
    series("kvctl_kv_tier_load_failures_total", tier="disk", reason="checksum"): 3,
    series("kvctl_kv_tier_load_failures_total", tier="disk", reason="io"): 0,
    series("kvctl_kv_tier_filesystem_free_bytes", tier="disk"): 50_000_000_000,
    series("kvctl_kv_tier_filesystem_size_bytes", tier="disk"): 1_000_000_000_000,
}


def expected_for_full_snapshot() -> Samples:
    expected = {
        series("kvctl_build_info", version=__version__): 1,
        series("kvctl_pool_capacity_pages"): 1024,
        series("kvctl_pool_page_size_tokens"): 16,
        series("kvctl_pool_used_pages"): 600,
        series("kvctl_pool_cached_pages"): 100,
        series("kvctl_pool_free_pages"): 324,
        series("kvctl_pool_capacity_bytes"): 1024 * 4096,
        series("kvctl_pool_used_bytes"): 600 * 4096,
        series("kvctl_pool_utilization_ratio"): 700 / 1024,
        series("kvctl_pool_segments"): 4,
        series("kvctl_pool_max_pages"): 2048,
        series("kvctl_pool_fragmentation_ratio"): 1 - 243 / (324 - 17),
        series("kvctl_pool_free_extents"): 7,
        series("kvctl_pool_largest_free_run_pages"): 243,
        series("kvctl_pool_reserved_pages"): 17,
        series("kvctl_pool_page_groups"): 7,
        series("kvctl_pool_window_pages"): 120,
        series("kvctl_pool_window_released_pages_total"): 4500,
        series("kvctl_prefix_pins"): 2,
        series("kvctl_prefix_pinned_pages"): 40,
        series("kvctl_prefix_pin_cap_pages"): 256,
        series("kvctl_alloc_attempts_total"): 1000,
        series("kvctl_alloc_failures_total"): 3,
        series("kvctl_alloc_success_ratio"): 0.99,
        series("kvctl_prefix_cache_queries_tokens_total"): 50_000,
        series("kvctl_prefix_cache_hits_tokens_total", tier="device"): 8960,
        series("kvctl_prefix_cache_hits_tokens_total", tier="host"): 2400,
        series("kvctl_prefix_cache_hits_tokens_total", tier="disk"): 640,
        series("kvctl_prefix_cache_hit_ratio"): 0.2,
        series("kvctl_defrag_runs_total", trigger="manual"): 2,
        series("kvctl_defrag_runs_total", trigger="threshold"): 5,
        series("kvctl_defrag_runs_total", trigger="extents"): 0,
        series("kvctl_defrag_runs_total", trigger="alloc_failure"): 0,
        series("kvctl_defrag_runs_total", trigger="shrink"): 0,
        series("kvctl_defrag_pages_moved_total"): 321,
        series("kvctl_pool_resizes_total", direction="grow"): 1,
        series("kvctl_pool_resizes_total", direction="shrink"): 0,
        series("kvctl_requests_running"): 9,
        series("kvctl_requests_waiting"): 13,
        series("kvctl_preemptions_total"): 17,
        series("kvctl_pool_pressure_ratio"): 600 / 1024,
        series("kvctl_requests_max_waiting"): 256,
        series("kvctl_oldest_waiting_seconds"): 4.5,
        series("kvctl_queue_stalled_seconds"): 1.5,
        series("kvctl_requests_finished_total", reason="stop"): 40,
        series("kvctl_requests_finished_total", reason="length"): 60,
        series("kvctl_requests_finished_total", reason="abort"): 2,
        series("kvctl_requests_finished_total", reason="capacity"): 0,
        series("kvctl_requests_rejected_total", reason="queue_full"): 7,
        series("kvctl_requests_rejected_total", reason="too_large"): 1,
        series("kvctl_requests_rejected_total", reason="invalid"): 0,
        series("kvctl_requests_rejected_total", reason="shutting_down"): 0,
        series("kvctl_admin_actions_total", action="defrag"): 0,
        series("kvctl_admin_actions_total", action="resize"): 1,
        series("kvctl_admin_actions_total", action="release"): 0,
        series("kvctl_admin_actions_total", action="config"): 2,
        series("kvctl_admin_actions_total", action="alert_test"): 0,
        series("kvctl_admin_actions_total", action="prefix_pin"): 0,
        series("kvctl_admin_actions_total", action="prefix_unpin"): 0,
        series("kvctl_admin_actions_total", action="prefix_clear"): 0,
        series("kvctl_admin_actions_total", action="prefix_move"): 0,
        series("kvctl_pool_rebalances_total", direction="in"): 3,
        series("kvctl_pool_rebalances_total", direction="out"): 0,
        series("kvctl_pool_rebalanced_bytes_total", direction="in"): 3 * 2**20,
        series("kvctl_pool_rebalanced_bytes_total", direction="out"): 0,
        series("kvctl_kv_budget_bytes"): 8 * 2**20,
        series("kvctl_kv_budget_assigned_bytes"): 6 * 2**20,
        series("kvctl_pool_floor_pages"): 256,
        series("kvctl_pool_ceiling_pages"): 2048,
        series("kvctl_pool_pinned"): 1,
        series("kvctl_pool_under_pressure"): 1,
        series("kvctl_pool_reclaimable_pages"): 0,
        series("kvctl_alertmanager_notifications_dropped_total"): 2,
        series(
            "kvctl_alerts_active",
            alertname="KvctlPoolNearlyFull",
            severity="critical",
            state="firing",
        ): 1,
        series("kvctl_kv_events_published_batches_total"): 900,
        series("kvctl_kv_events_dropped_batches_total"): 4,
        series("kvctl_kv_events_dropped_total"): 37,
        series("kvctl_kv_events_replay_ignored_total"): 12,
        series("kvctl_gpu_memory_used_bytes", gpu="0"): 70 * GIB,
        series("kvctl_gpu_memory_used_bytes", gpu="1"): 5 * GIB,
        series("kvctl_gpu_memory_total_bytes", gpu="0"): 141 * GIB,
        series("kvctl_gpu_memory_total_bytes", gpu="1"): 141 * GIB,
        series("kvctl_prompt_tokens_total"): 5000,
        series("kvctl_generation_tokens_total"): 1200,
        series("kvctl_prefix_cache_evicted_pages_total"): 11,
        series("kvctl_prefill_seconds_per_token"): 0.0004,
        series("kvctl_pool_token_slots_used"): 8192,
        series("kvctl_pool_token_usage_ratio"): 8192 / (1024 * 16),
        series("kvctl_preemptions_by_reason_total", reason="growth"): 15,
        series("kvctl_preemptions_by_reason_total", reason="pool_too_small"): 0,
        series("kvctl_preemptions_by_reason_total", reason="shrink"): 2,
        series("kvctl_prefix_evicted_pages_by_reason_total", reason="allocation"): 9,
        series("kvctl_prefix_evicted_pages_by_reason_total", reason="shrink"): 2,
        series("kvctl_prefix_evicted_pages_by_reason_total", reason="clear"): 0,
        series("kvctl_prefix_evicted_pages_by_reason_total", reason="sleep"): 0,
        series("kvctl_requests_rejected_total", reason="wake_failed"): 0,
        series("kvctl_admin_actions_total", action="sleep"): 0,
        series("kvctl_admin_actions_total", action="wake"): 0,
        series("kvctl_model_sleep_level"): 2,
        series("kvctl_model_waking"): 1,
        series("kvctl_model_sleep_released_bytes"): 3 * 2**20,
        series("kvctl_model_sleeps_total", trigger="manual"): 1,
        series("kvctl_model_sleeps_total", trigger="idle"): 0,
        series("kvctl_model_wakes_total", trigger="manual"): 0,
        series("kvctl_model_wakes_total", trigger="request"): 3,
        **TIER_SERIES,
    }
    empty = (
        ("kvctl_defrag_duration_seconds", DEFRAG_DURATION_BUCKETS),
        ("kvctl_time_to_first_token_seconds", TIME_TO_FIRST_TOKEN_BUCKETS),
        ("kvctl_inter_token_latency_seconds", INTER_TOKEN_BUCKETS),
        ("kvctl_request_latency_seconds", REQUEST_BUCKETS),
        ("kvctl_request_queue_time_seconds", QUEUE_BUCKETS),
        ("kvctl_prefix_page_lifetime_seconds", RESIDENCY_BUCKETS),
        ("kvctl_prefix_page_idle_before_eviction_seconds", RESIDENCY_BUCKETS),
        ("kvctl_prefix_reuse_gap_seconds", RESIDENCY_BUCKETS),
        ("kvctl_model_wake_seconds", WAKE_BUCKETS),
    )
    for name, bounds in empty:
        expected[series(f"{name}_count")] = 0
        expected[series(f"{name}_sum")] = 0
        for bound in [*bounds, math.inf]:
            le = "+Inf" if bound == math.inf else repr(bound)
            expected[series(f"{name}_bucket", le=le)] = 0
    return expected


# ---- the exposition -------------------------------------------------------------------------


def test_every_series_has_its_exact_value_and_labels() -> None:
    assert kvctl_samples(scrape(make_snapshot())) == expected_for_full_snapshot()


def test_families_have_the_declared_types() -> None:
    declared = {m.name.removesuffix("_total"): m.type for m in METRICS}
    parsed = {
        f.name: f.type
        for f in text_string_to_metric_families(scrape(make_snapshot()))
        if f.name.startswith("kvctl_")
    }
    assert parsed == declared


def test_no_created_series_and_every_series_carries_pool() -> None:
    text = scrape(make_snapshot())
    assert "_created" not in text
    for family in text_string_to_metric_families(text):
        for s in family.samples:  # process_* and python_info included
            assert s.labels.get("pool") == "llama-3-8b", s


def test_no_host_label() -> None:
    for family in text_string_to_metric_families(scrape(make_snapshot())):
        for s in family.samples:
            assert not {"host", "hostname", "instance", "node"} & set(s.labels), s


def test_process_metrics_are_served() -> None:
    names = {f.name for f in text_string_to_metric_families(scrape(make_snapshot()))}
    assert "python_info" in names
    if Path("/proc/self/stat").exists():
        assert {"process_resident_memory_bytes", "process_cpu_seconds"} <= names


def test_cpu_host_has_no_gpu_series() -> None:
    text = scrape(make_snapshot(gpus=[]))
    assert "kvctl_gpu_" not in text  # not even HELP/TYPE lines of an empty family
    expected = {
        key: value
        for key, value in expected_for_full_snapshot().items()
        if not key[0].startswith("kvctl_gpu_")
    }
    assert kvctl_samples(text) == expected


def test_empty_windows_and_unset_limit_are_left_out() -> None:
    snapshot = make_snapshot(alloc_success_ratio=None, prefix_hit_ratio=None, max_pool_pages=None)
    samples = kvctl_samples(scrape(snapshot))
    names = {name for name, _ in samples}
    assert not {"kvctl_alloc_success_ratio", "kvctl_prefix_cache_hit_ratio"} & names
    assert "kvctl_pool_max_pages" not in names
    assert "kvctl_alloc_attempts_total" in names  # the counters stay


def test_zero_ratio_is_a_value_not_an_absence() -> None:
    samples = kvctl_samples(scrape(make_snapshot(alloc_success_ratio=0.0, prefix_hit_ratio=0.0)))
    assert samples[series("kvctl_alloc_success_ratio")] == 0.0
    assert samples[series("kvctl_prefix_cache_hit_ratio")] == 0.0


def test_every_label_value_appears_from_the_start() -> None:
    samples = kvctl_samples(scrape(make_snapshot(defrag_runs_total={}, resizes_total={})))
    triggers = {
        dict(labels)["trigger"]
        for name, labels in samples
        if name == "kvctl_defrag_runs_total" and samples[name, labels] == 0
    }
    assert triggers == {"manual", "threshold", "extents", "alloc_failure", "shrink"}
    directions = {dict(labels)["direction"] for name, labels in samples if "resizes" in name}
    assert directions == {"grow", "shrink"}


def test_snapshot_is_read_once_per_scrape() -> None:
    calls = []

    def snapshot_fn() -> PoolSnapshot:
        calls.append(1)
        return make_snapshot()

    registry = build_registry(snapshot_fn, Histograms())
    calls.clear()
    render(registry)
    assert len(calls) == 1


def test_registries_are_independent() -> None:
    first = build_registry(lambda: make_snapshot(pool="a"), Histograms())
    second = build_registry(lambda: make_snapshot(pool="b"), Histograms())
    assert b'pool="a"' in render(first)[0]
    assert b'pool="b"' not in render(first)[0]
    assert b'pool="b"' in render(second)[0]


# ---- tiers below the device pool ------------------------------------------------------------


def tier_series(samples: Samples) -> set[tuple[str, str]]:
    """(family, tier) of every series that has a `tier` label."""
    return {(name, dict(labels)["tier"]) for name, labels in samples if "tier" in dict(labels)}


def test_hits_by_tier_add_up_to_every_hit() -> None:
    samples = kvctl_samples(scrape(make_snapshot()))
    hits = {
        dict(labels)["tier"]: value
        for (name, labels), value in samples.items()
        if name == "kvctl_prefix_cache_hits_tokens_total"
    }
    assert hits == {"device": 8960, "host": 2400, "disk": 640}
    assert sum(hits.values()) == make_snapshot().prefix_hits_tokens_total


def test_an_agent_without_tiers_has_only_device_hits_and_no_tier_series() -> None:
    snapshot = make_snapshot(tiers=[], prefix_hits_tokens_by_tier={"device": 12_000})
    samples = kvctl_samples(scrape(snapshot))
    assert tier_series(samples) == {("kvctl_prefix_cache_hits_tokens_total", "device")}
    assert samples[series("kvctl_prefix_cache_hits_tokens_total", tier="device")] == 12_000
    text = scrape(snapshot)
    assert "kvctl_kv_tier_" not in text  # not even HELP/TYPE lines of an empty family


def test_a_snapshot_without_the_split_counts_every_hit_on_the_device() -> None:
    samples = kvctl_samples(scrape(make_snapshot(tiers=[], prefix_hits_tokens_by_tier={})))
    assert samples[series("kvctl_prefix_cache_hits_tokens_total", tier="device")] == 12_000


def test_a_tier_never_given_room_has_no_series() -> None:
    """A disk-only agent lists an empty host tier: it was never configured, so it has none."""
    idle_host = tier_reading("host", capacity_pages=0)
    snapshot = make_snapshot(
        tiers=[idle_host, disk_tier()],
        prefix_hits_tokens_by_tier={"device": 11_360, "host": 0, "disk": 640},
    )
    samples = kvctl_samples(scrape(snapshot))
    assert {tier for _, tier in tier_series(samples)} == {"device", "disk"}
    assert {name for name, tier in tier_series(samples) if tier == "disk"} == {
        name for name, _ in TIER_SERIES
    } | {"kvctl_prefix_cache_hits_tokens_total"}
    hits = [v for (n, _), v in samples.items() if n == "kvctl_prefix_cache_hits_tokens_total"]
    assert sum(hits) == 12_000


def test_a_tier_turned_off_after_use_keeps_its_counters() -> None:
    off = host_tier(capacity_pages=0, used_pages=0)
    samples = kvctl_samples(scrape(make_snapshot(tiers=[off, disk_tier()])))
    assert samples[series("kvctl_kv_tier_capacity_bytes", tier="host")] == 0
    assert samples[series("kvctl_kv_tier_stored_pages_total", tier="host")] == 5000
    assert samples[series("kvctl_prefix_cache_hits_tokens_total", tier="host")] == 2400


def test_only_the_disk_tier_has_filesystem_series_and_only_when_readable() -> None:
    samples = kvctl_samples(scrape(make_snapshot()))
    filesystem = {s for s in tier_series(samples) if "filesystem" in s[0]}
    assert filesystem == {
        ("kvctl_kv_tier_filesystem_free_bytes", "disk"),
        ("kvctl_kv_tier_filesystem_size_bytes", "disk"),
    }
    gone = disk_tier(filesystem_free_bytes=None, filesystem_size_bytes=None)
    text = scrape(make_snapshot(tiers=[host_tier(), gone]))
    assert "kvctl_kv_tier_filesystem_" not in text
    assert 'kvctl_kv_tier_used_bytes{pool="llama-3-8b",tier="disk"}' in text


def test_prefill_seconds_per_token_is_absent_until_measured() -> None:
    families = text_string_to_metric_families(scrape(make_snapshot(prefill_seconds_per_token=None)))
    assert "kvctl_prefill_seconds_per_token" not in {f.name for f in families}
    samples = kvctl_samples(scrape(make_snapshot()))
    assert samples[series("kvctl_prefill_seconds_per_token")] == 0.0004


def test_every_failure_reason_appears_from_the_start() -> None:
    fresh = tier_reading("disk", store_failures_total={}, load_failures_total={})
    samples = kvctl_samples(scrape(make_snapshot(tiers=[fresh])))
    reasons = {
        (name, dict(labels)["reason"])
        for (name, labels), value in samples.items()
        if "failures" in name and value == 0
    }
    assert reasons == {
        ("kvctl_kv_tier_store_failures_total", "full"),
        ("kvctl_kv_tier_store_failures_total", "io"),
        ("kvctl_kv_tier_load_failures_total", "missing"),
        ("kvctl_kv_tier_load_failures_total", "truncated"),
        ("kvctl_kv_tier_load_failures_total", "checksum"),
        ("kvctl_kv_tier_load_failures_total", "io"),
    }


# ---- the defrag-duration histogram ----------------------------------------------------------


def test_histogram_buckets_are_cumulative_with_count_and_sum() -> None:
    durations = DurationHistogram(buckets=(0.001, 0.01, 0.1))
    for seconds in (0.0005, 0.001, 0.002, 0.05, 0.05, 3.0):
        durations.observe(seconds)
    samples = kvctl_samples(scrape(make_snapshot(), durations))
    buckets = {
        dict(labels)["le"]: value
        for (name, labels), value in samples.items()
        if name == "kvctl_defrag_duration_seconds_bucket"
    }
    # le=0.001 holds 0.0005 and 0.001 (a bound is inclusive); +Inf holds all six
    assert buckets == {"0.001": 2, "0.01": 3, "0.1": 5, "+Inf": 6}
    assert samples[series("kvctl_defrag_duration_seconds_count")] == 6
    assert samples[series("kvctl_defrag_duration_seconds_sum")] == pytest.approx(3.1035)


def test_histogram_read_is_a_copy() -> None:
    durations = DurationHistogram(buckets=(1.0,))
    durations.observe(0.5)
    reading = durations.read()
    durations.observe(2.0)
    assert (reading.cumulative, reading.count, reading.sum) == ((1, 1), 1, 0.5)
    assert durations.read().cumulative == (1, 2)


def test_histogram_counts_every_observation_from_many_threads() -> None:
    durations = DurationHistogram(buckets=(0.5,))

    def observe() -> None:
        for _ in range(20_000):
            durations.observe(0.25)

    threads = [threading.Thread(target=observe) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reading = durations.read()
    assert reading.cumulative == (80_000, 80_000)
    assert reading.sum == 80_000 * 0.25


@pytest.mark.parametrize("seconds", [-0.001, math.nan])
def test_histogram_refuses_impossible_durations(seconds: float) -> None:
    durations = DurationHistogram()
    with pytest.raises(ValueError, match="duration"):
        durations.observe(seconds)
    assert durations.read().count == 0


@pytest.mark.parametrize("buckets", [(), (0.1, 0.1), (0.2, 0.1), (0.0, 1.0), (1.0, math.inf)])
def test_histogram_refuses_bad_buckets(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="buckets"):
        DurationHistogram(buckets)


# ---- the table ------------------------------------------------------------------------------

PROMISED_NAMES = PROMISED_METRICS


def test_table_covers_design_and_has_no_duplicates() -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert not PROMISED_NAMES - set(names), PROMISED_NAMES - set(names)


def test_names_follow_prometheus_conventions() -> None:
    non_base_units = re.compile(  # a base unit may be followed by `_per_` (seconds per token)
        r"_(milli|micro|nano|kilo|mega|giga|k|m|g|ki|mi|gi)?(seconds|bytes|b)_(?!per_)|"
        r"_(ms|us|ns|kb|mb|gb|kib|mib|gib|minutes|hours|days|percent|perc|pct)(_|$)"
    )
    for metric in METRICS:
        assert re.fullmatch(r"kvctl_[a-z][a-z0-9_]*[a-z0-9]", metric.name), metric.name
        assert metric.name.endswith("_total") == (metric.type == "counter"), metric.name
        assert not non_base_units.search(metric.name.removesuffix("_total")), metric.name
        assert "pool" not in metric.labels and "le" not in metric.labels
        assert metric.help.endswith("."), metric.name


def test_ratios_are_fractions_in_the_exposition() -> None:
    for (name, _), value in kvctl_samples(scrape(make_snapshot())).items():
        if name.endswith("_ratio"):
            assert 0.0 <= value <= 1.0, name


# ---- docs -----------------------------------------------------------------------------------


def test_docs_are_generated_from_the_table() -> None:
    committed = (ROOT / "docs" / "metrics.md").read_text()
    assert committed == metrics_markdown(), (
        "docs/metrics.md is stale: python -m kvctl.agent.observe.metrics_docs > docs/metrics.md"
    )


def test_docs_name_every_metric_and_the_recording_rules() -> None:
    text = metrics_markdown()
    for metric in METRICS:
        assert f"| `{metric.name}` | {metric.type} |" in text
    assert "kvctl:alloc_success:ratio_rate5m" in text
    assert "kvctl:prefix_hit:ratio_rate5m" in text
