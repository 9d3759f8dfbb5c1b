"""kvctl.agent.api_views: the pool core's plain readings become the API's models in one place.

The views carry every field; the ratios the core and the API compute agree (both take them from
`kvctl.occupancy`); and the JSON of a real agent's snapshot and defrag keeps its shape, key for
key and in order (what clients and docs/api.md read).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields

import pytest
from fastapi.testclient import TestClient
from one_pool import one_pool_service

from kvctl import api
from kvctl.agent.api_views import (
    defrag_view,
    occupancy_fields,
    occupancy_view,
    resize_direction,
    resize_view,
    tier_name,
    tier_view,
)
from kvctl.agent.config import AgentConfig
from kvctl.agent.http.server import create_app
from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.pool import Defragmenter, DefragReport, DefragTrigger, PagePool, PoolOccupancy
from kvctl.agent.tiers import TierStats
from kvctl.agent.tiers.tiered_store import TierCounters

OCCUPANCY_KEYS = [
    "page_size",
    "bytes_per_page",
    "segment_pages",
    "segments",
    "capacity_pages",
    "used_pages",
    "cached_pages",
    "free_pages",
    "free_extents",
    "largest_free_run",
    "reserved_pages",
    "sequences",
    "alloc_attempts_total",
    "alloc_failures_total",
    "contiguous_misses_total",
]
DERIVED_KEYS = [
    "capacity_bytes",
    "used_bytes",
    "utilization_ratio",
    "pressure_ratio",
    "free_run_pages",
    "fragmentation_ratio",
]
DEFRAG_KEYS = [
    "trigger",
    "fragmentation_before",
    "fragmentation_after",
    "free_extents_before",
    "free_extents_after",
    "pages_moved",
    "bytes_moved",
    "seconds",
    "complete",
]
SNAPSHOT_KEYS = [
    *OCCUPANCY_KEYS,
    "pool",
    "timestamp",
    "device",
    "prompt_tokens_total",
    "generation_tokens_total",
    "max_pool_pages",
    "alloc_success_ratio",
    "window_seconds",
    "prefix_cache_enabled",
    "prefix_queries_tokens_total",
    "prefix_hits_tokens_total",
    "prefix_hit_ratio",
    "prefix_evictions_total",
    "prefix_hits_tokens_by_tier",
    "tiers",
    "prefill_seconds_per_token",
    "defrag_runs_total",
    "defrag_pages_moved_total",
    "defrag_active",
    "last_defrag",
    "last_defrag_age_seconds",
    "auto_defrag_enabled",
    "resizes_total",
    "requests_running",
    "requests_waiting",
    "preemptions_total",
    "page_groups",
    "window_pages",
    "window_released_pages_total",
    "prefix_pins",
    "prefix_pinned_pages",
    "prefix_pin_cap_pages",
    "token_slots_used",
    "preemptions_by_reason_total",
    "prefix_evictions_by_reason_total",
    "prefix_residency",
    "alert_notifications_dropped_total",
    "gpus",
    "max_waiting",
    "oldest_waiting_seconds",
    "queue_stalled_seconds",
    "window_alloc_attempts",
    "window_alloc_failures",
    "requests_finished_total",
    "requests_rejected_total",
    "admin_actions_total",
    "share",
    "sleep",
    *DERIVED_KEYS,
    "token_usage_ratio",
]


def reading(**changes: int) -> PoolOccupancy:
    """A core reading: 64 pages, 20 used, 4 cached, 40 free in 3 runs (the largest 30, 2 of
    the free pages reserved), with `changes`."""
    base = dict(
        page_size=16,
        bytes_per_page=4096,
        segment_pages=16,
        segments=4,
        capacity_pages=64,
        used_pages=20,
        cached_pages=4,
        free_pages=40,
        free_extents=3,
        largest_free_run=30,
        reserved_pages=2,
        sequences=5,
        alloc_attempts_total=9,
        alloc_failures_total=1,
        contiguous_misses_total=2,
    )
    return PoolOccupancy(**{**base, **changes})


def fragmented() -> PagePool:
    """12 pages of 4 tokens: a=[0,1] c=[4,5] e=[8,9] f=[10,11]; free [2,3] and [6,7]."""
    pool = PagePool(12, 4, segment_pages=4, bytes_per_page=10)
    for name in "abcdef":
        pool.allocate(name, 8)
    pool.free("b")
    pool.free("d")
    return pool


def _properties(cls: type) -> set[str]:
    return {name for name in dir(cls) if isinstance(getattr(cls, name), property)}


# ---- the same fields on both sides ------------------------------------------------------------


def test_the_core_readings_and_the_api_models_have_the_same_fields() -> None:
    assert [f.name for f in fields(PoolOccupancy)] == OCCUPANCY_KEYS
    assert list(api.PoolOccupancy.model_fields) == OCCUPANCY_KEYS
    assert _properties(PoolOccupancy) == set(api.PoolOccupancy.model_computed_fields)
    assert list(api.PoolOccupancy.model_computed_fields) == DERIVED_KEYS
    assert [f.name for f in fields(DefragReport)] == list(api.DefragResult.model_fields)
    assert list(api.DefragResult.model_fields) == DEFRAG_KEYS


def test_the_core_readings_are_frozen_plain_data() -> None:
    occupancy = reading()
    with pytest.raises(AttributeError):
        occupancy.used_pages = 0  # type: ignore[misc]  # frozen: what the test checks
    assert not hasattr(occupancy, "__dict__")  # slots
    assert not hasattr(occupancy, "model_dump")


def test_the_occupancy_view_carries_every_field_of_a_real_pool() -> None:
    pool = fragmented()
    pool.allocate("g", 3)  # one page more: a free run splits
    core = pool.stats()
    view = occupancy_view(core)
    assert isinstance(view, api.PoolOccupancy)
    for name in [*OCCUPANCY_KEYS, *DERIVED_KEYS]:
        assert getattr(view, name) == getattr(core, name), name
    assert occupancy_fields(core) == {name: getattr(core, name) for name in OCCUPANCY_KEYS}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(
            capacity_pages=0,
            used_pages=0,
            cached_pages=0,
            free_pages=0,
            free_extents=0,
            largest_free_run=0,
            reserved_pages=0,
            segments=0,
        ),
        dict(
            used_pages=60,
            cached_pages=4,
            free_pages=0,
            free_extents=0,
            largest_free_run=0,
            reserved_pages=0,
        ),  # full: no free page, fragmentation 0
        dict(free_pages=40, reserved_pages=40, free_extents=0, largest_free_run=0),  # all held back
        dict(free_extents=40, largest_free_run=1, reserved_pages=0),  # scattered
        dict(used_pages=7, cached_pages=0, capacity_pages=3 * 7, free_pages=14, largest_free_run=5),
    ],
)
def test_the_ratios_agree_between_the_core_and_the_api(changes: dict[str, int]) -> None:
    core = reading(**changes)
    view = occupancy_view(core)
    dumped = view.model_dump()
    for name in DERIVED_KEYS:
        assert getattr(core, name) == getattr(view, name) == dumped[name], name
    assert core.utilization_ratio == (
        (core.used_pages + core.cached_pages) / core.capacity_pages if core.capacity_pages else 0.0
    )
    free_run = core.free_pages - core.reserved_pages
    assert core.fragmentation_ratio == (1 - core.largest_free_run / free_run if free_run else 0.0)


def test_the_defrag_view_carries_every_field_of_a_real_run() -> None:
    pool = fragmented()
    report = Defragmenter(pool).run(DefragTrigger.MANUAL)
    assert isinstance(report, DefragReport) and report.pages_moved == 4 and report.complete
    view = defrag_view(report)
    assert isinstance(view, api.DefragResult)
    assert view.trigger == "manual" and type(view.trigger) is str
    for name in DEFRAG_KEYS[1:]:
        assert getattr(view, name) == getattr(report, name), name
    assert list(json.loads(view.model_dump_json())) == DEFRAG_KEYS


def test_the_tier_view_carries_every_field() -> None:
    counters = TierCounters()
    counters.hits_tokens, counters.stored_pages, counters.loaded_bytes = 12, 3, 4096
    stats = TierStats("disk", "lru", 100, 7, 1000, counters, "/tmp/tier", (5, 50))
    view = tier_view(stats)
    assert (view.tier, view.policy, view.capacity_pages, view.used_pages) == ("disk", "lru", 100, 7)
    assert (view.capacity_bytes, view.used_bytes) == (stats.capacity_bytes, stats.used_bytes)
    assert (view.hits_tokens_total, view.stored_pages_total, view.loaded_bytes_total) == (
        12,
        3,
        4096,
    )
    assert (view.path, view.filesystem_free_bytes, view.filesystem_size_bytes) == (
        "/tmp/tier",
        5,
        50,
    )
    assert view.store_failures_total == dict(counters.store_failures)
    with pytest.raises(ValueError, match="no tier named 'tape'"):
        tier_name("tape")


def test_the_resize_view_names_its_direction() -> None:
    assert [resize_direction(4, n) for n in (8, 2, 4)] == ["grow", "shrink", "none"]
    grown = resize_view(32, 64, 100, pages_moved=0, pages_evicted=1)
    assert (grown.direction, grown.old_bytes, grown.new_bytes, grown.tier) == (
        "grow",
        3200,
        6400,
        "device",
    )
    assert resize_view(8, 4, 10, tier="host").tier == "host"


# ---- a real agent's JSON ----------------------------------------------------------------------


def test_a_real_snapshot_is_built_from_the_views(make_engine) -> None:
    service = one_pool_service(make_engine(), api.RuntimeSettings())
    engine = service.pools["demo"].engine
    engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3))
    result = service.pool(None).defrag_now(None)
    assert isinstance(result, api.DefragResult) and result.trigger == "manual"
    _, snapshot = service.pool(None).page_states_and_snapshot()
    core = engine.pool.stats()
    assert snapshot.model_dump(include=set(OCCUPANCY_KEYS + DERIVED_KEYS)) == (
        occupancy_view(core).model_dump()
    )
    assert snapshot.last_defrag == result
    assert list(json.loads(snapshot.model_dump_json())) == SNAPSHOT_KEYS


def test_the_json_of_a_real_agent_keeps_its_shape(make_engine) -> None:
    service = one_pool_service(make_engine(), api.RuntimeSettings())
    app = create_app(service, AgentConfig())
    with TestClient(app) as http:
        defrag = http.post("/v1/defrag", json={})
        assert defrag.status_code == 200, defrag.text
        assert list(defrag.json()) == DEFRAG_KEYS
        body = http.get("/v1/pool").json()
        assert list(body) == SNAPSHOT_KEYS
        assert list(body["last_defrag"]) == DEFRAG_KEYS
        assert body["utilization_ratio"] == (
            (body["used_pages"] + body["cached_pages"]) / body["capacity_pages"]
        )
        assert body["capacity_bytes"] == body["capacity_pages"] * body["bytes_per_page"]
        assert list(http.get("/v1/pools").json()["pools"][0]) == SNAPSHOT_KEYS


# ---- the layering -----------------------------------------------------------------------------


def test_the_pool_core_loads_without_the_api() -> None:
    """The core returns plain dataclasses: importing it loads neither `kvctl.api` nor the
    views (ruff's banned-api rules in its `ruff.toml` keep the sources so)."""
    code = (
        "import sys, kvctl.agent.pool, kvctl.agent.prefix, kvctl.agent.budget; "
        "print(sorted(m for m in ('kvctl.api', 'kvctl.agent.api_views') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
