"""Residency and honest usage: token slots beside pages (shared pages counted once, partly
filled and reserved pages not counted as tokens), preemptions and evictions by reason, and the
residency histograms timed on the cache's clock."""

import pytest

from kvctl.agent.model import SamplingParams
from kvctl.agent.prefix.residency import RESIDENCY_BUCKETS, DurationCounts
from kvctl.agent.runtime import Engine

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def drain(engine: Engine) -> None:
    while engine.has_work():
        engine.step()
        engine.pool.invariants.check()


def bucket(counts: DurationCounts, seconds: float) -> int:
    """The count of the bucket `seconds` falls in."""
    index = next((i for i, b in enumerate(counts.bounds) if seconds <= b), len(counts.bounds))
    return counts.counts[index]


def test_token_slots_count_written_tokens_and_shared_pages_once(make_engine) -> None:
    engine = make_engine(page_size=4)
    first = engine.add_request(list(range(40, 50)), GREEDY)  # 10 tokens: 3 pages
    engine.step()
    stats = engine.stats
    assert first.num_computed == 10 and stats.pool.used_pages == 3
    assert stats.token_slots_used == 10  # 12 slots, 2 empty at the end of the last page
    drain(engine)
    second = engine.add_request([*range(40, 48), 90, 91], GREEDY)  # shares 2 whole pages
    third = engine.add_request([*range(40, 48), 92, 93, 94], GREEDY)
    engine.step()
    stats = engine.stats
    assert second.cached_tokens == third.cached_tokens == 8
    # 2 shared pages (8 tokens, counted once) + each request's own page with 2 and 3 tokens
    assert stats.pool.used_pages == 4
    assert stats.token_slots_used == 8 + 2 + 3
    drain(engine)
    assert engine.stats.token_slots_used == 0


def test_preemptions_and_evictions_are_counted_by_reason(make_engine) -> None:
    engine = make_engine(page_size=4, pool_pages=8, segment_pages=8)
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for base in (10, 30, 50):
        engine.add_request([base + i for i in range(8)], long)
    drain(engine)
    stats = engine.stats
    assert stats.preemptions_by_reason["growth"] == stats.preemptions > 0
    assert stats.prefix_evictions_by_reason["allocation"] > 0
    cache = engine.prefix_cache
    assert cache is not None
    cached = engine.pool.cached_pages
    assert cached and cache.clear() == cached
    assert engine.stats.prefix_evictions_by_reason["clear"] == cached
    engine.add_request(list(range(60, 72)), long)
    engine.step()
    assert engine.scheduler.preempt_to_fit(0) == 1
    assert engine.stats.preemptions_by_reason["shrink"] == 1


def test_residency_is_timed_on_the_cache_clock(make_engine) -> None:
    engine = make_engine(page_size=4)
    cache = engine.prefix_cache
    assert cache is not None
    now = [1000.0]
    cache.clock = lambda: now[0]
    prompt = list(range(40, 56))  # 16 tokens: 4 whole pages
    engine.add_request(prompt, GREEDY)
    drain(engine)  # inserted at t = 1000
    now[0] = 1004.0
    [hit] = [engine.add_request([*prompt, 99], GREEDY)]
    drain(engine)
    assert hit.cached_tokens == 16
    residency = cache.residency
    assert sum(residency.reuse_gap.counts) == 1 and bucket(residency.reuse_gap, 4.0) == 1
    assert residency.reuse_gap.total == pytest.approx(4.0)
    now[0] = 1200.0
    pages = engine.pool.cached_pages
    assert cache.clear() == pages
    lifetime, idle = residency.lifetime, residency.idle_before_evict
    assert sum(lifetime.counts) == sum(idle.counts) == pages  # one observation per page
    assert bucket(lifetime, 200.0) == pages  # stored at 1000 (or split from it), evicted at 1200
    assert idle.total == pytest.approx(196.0 * pages)  # every page last used (or stored) at 1004
    assert sum(residency.reuse_gap.counts) == 1


def test_duration_counts_are_prometheus_buckets() -> None:
    counts = DurationCounts()
    counts.observe(0.05)
    counts.observe(7.0, weight=3)
    counts.observe(10**6)
    cumulative, total = counts.cumulative()
    assert len(cumulative) == len(RESIDENCY_BUCKETS) + 1
    assert cumulative[0] == 1 and cumulative[RESIDENCY_BUCKETS.index(15.0)] == 4
    assert cumulative[-1] == 5 and total == pytest.approx(0.05 + 21.0 + 10**6)
