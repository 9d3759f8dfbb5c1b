"""Prefix operations on one engine: lookups report what the next request reuses, pins keep a
prefix through an eviction storm, defrag and resize, within their cap and their time, and clears
purge one salt's partitions (device and tiers) and nothing else."""

import pytest

from kvctl.agent.model import SamplingParams
from kvctl.agent.pool import ResizeRefused
from kvctl.agent.runtime import Engine
from kvctl.agent.runtime.prefix_pins import PinRefused, PrefixOpRefused, UnknownPin

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SYSTEM = "Shared system prompt: answer briefly and cite the runbook, always. User: "


def run(engine: Engine, prompts: list[list[int]], salt: str | None = None) -> list:
    requests = [engine.add_request(p, GREEDY, cache_salt=salt) for p in prompts]
    while engine.has_work():
        engine.step()
        check(engine)
    return requests


def check(engine: Engine) -> None:
    engine.pool.invariants.check()
    if engine.prefix_cache is not None:
        engine.prefix_cache.check()


def storm(engine: Engine, rounds: int = 6) -> None:
    """Unique prompts that need the whole pool: without pins, every cached page goes."""
    for r in range(rounds):
        run(engine, [[50 + r, 60 + i] * 18 for i in range(3)])


def ops(engine: Engine):
    assert engine.prefix_ops is not None
    return engine.prefix_ops


def test_lookup_reports_what_the_next_request_reuses_and_keeps_salts_apart(make_engine, demo):
    engine = make_engine()
    system = demo[2].encode(SYSTEM)
    run(engine, [[*system, 70, 71]], salt="t1")
    found = ops(engine).lookup("t1", [*system, 90])
    whole = len(system) // 4 * 4
    assert found.device_tokens >= whole and found.device_pages == -(-found.device_tokens // 4)
    assert found.last_used_at is not None and found.pins == []
    assert ops(engine).lookup(None, [*system, 90]).device_tokens == 0
    assert ops(engine).lookup("t2", [*system, 90]).device_tokens == 0
    [request] = run(engine, [[*system, 90]], salt="t1")
    assert request.cached_tokens == min(found.device_tokens, len(system))


def test_a_pinned_prefix_survives_an_eviction_storm_and_unpinned_it_does_not(make_engine, demo):
    system = demo[2].encode(SYSTEM)
    reference = run(make_engine(prefix_cache=False), [[*system, 77]])[0].output_ids
    results = {}
    for pinned in (False, True):
        engine = make_engine()
        run(engine, [[*system, 70]])
        if pinned:
            pin = ops(engine).pin(None, system, ttl_s=None)
            assert pin.tokens == len(system) // 4 * 4 and engine.scheduler.pins.pinned_pages > 0
        storm(engine)
        assert engine.stats.prefix_evictions_total > 0
        [request] = run(engine, [[*system, 77]])
        assert request.output_ids == reference
        results[pinned] = request.cached_tokens
    assert results[False] == 0
    assert results[True] == len(system) // 4 * 4


def test_pins_survive_defrag_and_resize_and_a_shrink_below_them_names_them(make_engine, demo):
    system = demo[2].encode(SYSTEM)
    engine = make_engine(pool_pages=64, segment_pages=16)
    reference = run(make_engine(prefix_cache=False), [[*system, 77]])[0].output_ids
    run(engine, [[40 + i] * 30 for i in range(4)] + [[*system, 70]])
    ops(engine).max_pinned_share = 0.5
    pin = ops(engine).pin(None, system, ttl_s=None)
    engine.pool.evict(engine.pool.cached_pages)  # the others' pages go: holes below the pin
    engine.defragmenter.step(64)
    check(engine)
    engine.resizer.resize(engine.pool.used_pages + 16)  # a shrink that keeps the pin
    check(engine)
    with pytest.raises(ResizeRefused, match="pinned prefixes"):
        engine.resizer.resize(1)
    assert ops(engine).lookup(None, [*system, 1]).pins == [pin.pin_id]
    [request] = run(engine, [[*system, 77]])
    assert request.cached_tokens == pin.tokens and request.output_ids == reference


def test_pins_are_capped_and_a_refused_pin_changes_nothing(make_engine, demo):
    system = demo[2].encode(SYSTEM)
    engine = make_engine()
    run(engine, [[*system, 70]])
    ops(engine).max_pinned_share = 2 / engine.pool.capacity
    used = engine.pool.used_pages
    with pytest.raises(PinRefused, match="above the cap of 2"):
        ops(engine).pin(None, system, ttl_s=None)
    assert engine.pool.used_pages == used and len(engine.scheduler.pins) == 0
    with pytest.raises(PinRefused, match="nothing of this prefix is cached"):
        ops(engine).pin("other", system, ttl_s=None)
    check(engine)


def test_a_pin_ends_at_its_ttl_and_on_unpin_its_pages_stay_cached(make_engine, demo):
    system = demo[2].encode(SYSTEM)
    engine = make_engine()
    run(engine, [[*system, 70]])
    now = [1000.0]
    engine.scheduler.pins.wall = lambda: now[0]
    short = ops(engine).pin(None, system, ttl_s=30)
    held = ops(engine).pin(None, system[:8], ttl_s=None)
    assert short.expires_at == 1030.0 and ops(engine).expire() == []
    now[0] = 1030.0
    assert [p.pin_id for p in ops(engine).expire()] == [short.pin_id]
    check(engine)
    cached = engine.pool.cached_pages
    ops(engine).unpin(held.pin_id)
    assert engine.pool.used_pages == 0 and engine.pool.cached_pages > cached
    with pytest.raises(UnknownPin):
        ops(engine).unpin(held.pin_id)
    check(engine)


def test_clear_purges_one_salt_and_its_pins_and_leaves_the_others(make_engine, demo):
    system = demo[2].encode(SYSTEM)
    engine = make_engine()
    run(engine, [[*system, 70]], salt="gone")
    run(engine, [[*system, 70]], salt="kept")
    ops(engine).pin("gone", system, ttl_s=None)
    with pytest.raises(PrefixOpRefused, match="no host tier"):
        ops(engine).clear({"gone"}, {"device", "host"})
    assert len(engine.scheduler.pins) == 1
    report = ops(engine).clear({"gone"}, {"device"})
    check(engine)
    assert [p.salt for p in report.pins_removed] == ["gone"] and report.pages_in_use == 0
    assert report.pages_freed["device"] > 0
    assert ops(engine).lookup("gone", system).device_tokens == 0
    assert ops(engine).lookup("kept", system).device_tokens > 0
    report = ops(engine).clear(None, {"device"})
    assert engine.pool.cached_pages == 0 and report.pages_freed["device"] > 0


def test_clear_purges_a_salt_from_the_host_tier_too(make_engine, demo):
    system = demo[2].encode(SYSTEM)
    engine = make_engine(host_tier_bytes=64 << 20)
    run(engine, [[*system, 70]], salt="gone")
    run(engine, [[*system, 70]], salt="kept")
    engine.pool.evict(engine.pool.cached_pages)  # both spill to the host tier
    assert ops(engine).lookup("gone", system).tier_tokens["host"] >= len(system) // 4 * 4
    report = ops(engine).clear({"gone"}, {"device", "host"})
    assert report.pages_freed["host"] > 0
    assert ops(engine).lookup("gone", system).tier_tokens["host"] == 0
    assert ops(engine).lookup("kept", system).tier_tokens["host"] >= len(system) // 4 * 4
    [request] = run(engine, [[*system, 1]], salt="gone")
    assert request.cached_tokens == 0


def test_a_prefix_is_copied_into_the_host_tier_and_loaded_from_it(make_engine, demo):
    system = demo[2].encode(SYSTEM)
    whole = len(system) // 4 * 4
    engine = make_engine(host_tier_bytes=64 << 20)
    with pytest.raises(PrefixOpRefused, match="nothing of this prefix is cached"):
        ops(engine).store_below(None, system, "host")
    run(engine, [[*system, 70]])
    assert ops(engine).lookup(None, system).tier_tokens["host"] == 0
    assert ops(engine).store_below(None, system, "host") == whole
    found = ops(engine).lookup(None, system)
    assert found.tier_tokens["host"] == whole and found.device_tokens >= whole
    engine.pool.evict(engine.pool.cached_pages)
    check(engine)
    [request] = run(engine, [[*system, 77]])
    assert request.cached_tokens == whole
    assert engine.stats.prefix_hits_by_tier["host"] >= whole
    with pytest.raises(PrefixOpRefused, match="no disk tier"):
        ops(engine).store_below(None, system, "disk")
    with pytest.raises(PrefixOpRefused, match="no host tier"):
        ops(make_engine()).store_below(None, system, "host")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pins_lookups_and_clears_at_random_moments_change_no_token(make_engine, demo, seed):
    """Requests with shared prefixes in a small pool with a host tier, and at random moments
    pins (with and without a TTL), unpins, expiries, lookups, copies to the host tier, clears,
    defrag steps, evictions and resizes: every step keeps the pool's and the cache's
    invariants, and every request gets the tokens it gets alone in a pool large enough."""
    import contextlib
    import random

    rng = random.Random(seed)
    bases = [demo[2].encode(text) for text in (SYSTEM, SYSTEM[:30] + "!", "Other tenant: ")]
    prompts = [
        rng.choice(bases)[: rng.randint(8, 30)] + [rng.randrange(40, 120)] * rng.randint(1, 4)
        for _ in range(14)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(2, 10), ignore_eos=True)
        for _ in prompts
    ]
    salts = [rng.choice([None, "t1"]) for _ in prompts]
    reference = make_engine(prefix_cache=False)
    alone = [reference.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    while reference.has_work():
        reference.step()
    expected = [r.output_ids for r in alone]

    engine = make_engine(pool_pages=24, segment_pages=8, host_tier_bytes=16 << 20)
    now = [0.0]
    engine.scheduler.pins.wall = lambda: now[0]
    requests: list = []
    pinned = 0
    while len(requests) < len(prompts) or engine.has_work():
        action = rng.random()
        now[0] += 1.0
        if len(requests) < len(prompts) and action < 0.3:
            i = len(requests)
            requests.append(engine.add_request(prompts[i], params[i], cache_salt=salts[i]))
        elif action < 0.6:
            with contextlib.suppress(PrefixOpRefused, UnknownPin, ResizeRefused):
                pinned += operate(engine, rng, rng.choice(bases), rng.choice([None, "t1"]))
        elif engine.has_work():
            engine.step()
        check(engine)
    assert [r.output_ids for r in requests] == expected
    assert pinned > 0 and engine.stats.prefix_hits_tokens > 0


def operate(engine: Engine, rng, base: list[int], salt: str | None) -> int:
    """One operator's action, or a defrag, eviction or resize, chosen at random; 1 for a pin."""
    choice = rng.randrange(9)
    if choice == 0:
        ops(engine).pin(salt, base, ttl_s=rng.choice([None, 5.0]))
        return 1
    if choice == 1 and engine.scheduler.pins.all():
        ops(engine).unpin(rng.choice(engine.scheduler.pins.all()).pin_id)
    elif choice == 2:
        ops(engine).expire()
    elif choice == 3:
        assert ops(engine).lookup(salt, base).device_tokens <= len(base)
    elif choice == 4:
        ops(engine).store_below(salt, base, "host")
    elif choice == 5:
        ops(engine).clear({salt}, {"device", "host"})
    elif choice == 6:
        engine.defragmenter.step(rng.randint(1, 6))
    elif choice == 7:
        engine.pool.evict(rng.randint(1, 6))
    else:
        engine.resizer.resize(rng.choice([24, 32]))
    return 0
