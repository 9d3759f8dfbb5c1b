"""The prefix cache inside the engine: the same greedy tokens with and without it, usage counts,
isolation, run-time policy changes, and random interleavings with preemption, eviction,
defragmentation and resizes."""

import contextlib
import random

import pytest

from kvctl.agent.model import SamplingParams
from kvctl.agent.pool import ResizeRefused
from kvctl.agent.prefix import EVICTION_POLICIES
from kvctl.agent.runtime import Engine, EngineConfig, Request

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SYSTEM = "Shared system prompt: answer briefly and cite the runbook. User: "


def run_waves(engine: Engine, waves: list[list[list[int]]], salt: str | None = None):
    """Each wave is submitted together and runs to completion before the next one starts, so
    later waves find what earlier ones cached."""
    done: list[Request] = []
    for wave in waves:
        requests = [engine.add_request(p, GREEDY, cache_salt=salt) for p in wave]
        while engine.has_work():
            engine.step()
            engine.pool.invariants.check()
            if engine.prefix_cache is not None:
                engine.prefix_cache.check()
        done.extend(requests)
    return done


@pytest.mark.parametrize("page_size", [3, 4])
def test_greedy_tokens_are_the_same_with_and_without_the_cache(make_engine, demo, page_size):
    base = demo[2].encode(SYSTEM)
    mid_page, on_boundary = base[:10], base[:12]  # 10 is mid-page and 12 a boundary for 3 and 4
    other = demo[2].encode("zq")[1:]
    assert other[0] not in (base[10], base[12])
    waves = [
        [base[:20]],
        # run together: all adopt the same cached pages at once
        [mid_page + other, on_boundary + other, base[:20], base[:10]],
    ]
    expected = [r.output_ids for r in run_waves(make_engine(prefix_cache=False), waves)]
    engine = make_engine(page_size=page_size)
    requests = run_waves(engine, waves)
    assert [r.output_ids for r in requests] == expected
    # the whole prompt never matches: its last token is computed for the logits
    assert [r.cached_tokens for r in requests] == [0, 10, 12, 19, 9]
    stats = engine.stats
    assert stats.prefix_hits_tokens == 10 + 12 + 19 + 9
    assert stats.prefix_queries_tokens == sum(len(p) for wave in waves for p in wave)
    assert stats.prefix_hit_ratio == stats.prefix_hits_tokens / stats.prefix_queries_tokens
    assert stats.pool.used_pages == 0 and stats.pool.cached_pages == stats.prefix_cached_pages > 0


def test_different_salts_never_share_and_the_same_salt_does(make_engine, demo) -> None:
    engine = make_engine()
    prompt = demo[2].encode(SYSTEM)
    (a,) = run_waves(engine, [[prompt]], salt="tenant-a")
    (b,) = run_waves(engine, [[prompt]], salt="tenant-b")
    (none,) = run_waves(engine, [[prompt]])
    (a_again,) = run_waves(engine, [[prompt]], salt="tenant-a")
    assert [r.cached_tokens for r in (a, b, none, a_again)] == [0, 0, 0, len(prompt) - 1]
    assert len(engine.prefix_cache.partitions()) == 3
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(prompt, GREEDY, cache_salt="")


def test_sampling_isolation_keeps_different_sampling_settings_apart(make_engine, demo) -> None:
    prompt = demo[2].encode(SYSTEM)
    warm = SamplingParams(temperature=0.7, seed=1, max_tokens=4)
    for isolation, expected in (("salt", len(prompt) - 1), ("sampling", 0)):
        engine = make_engine(prefix_isolation=isolation)
        engine.generate([prompt], warm)
        (request,) = engine.generate([prompt], GREEDY)
        assert request.cached_tokens == expected, isolation


def test_a_preempted_request_finds_its_own_pages_again(make_engine, demo) -> None:
    prompts = [demo[2].encode(SYSTEM[:24] + str(i) * 6) for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = make_engine(prefix_cache=False)
    expected = [r.output_ids for r in reference.generate(prompts, params)]
    small = make_engine(pool_pages=32, segment_pages=16)  # 5 × 12 pages do not fit at once
    requests = small.generate(prompts, params)
    assert [r.output_ids for r in requests] == expected
    stats = small.stats
    assert stats.preemptions > 0
    # `cached_tokens` counts first admissions only: the rest of the hits are recomputations
    # after preemption that found their own pages
    assert stats.prefix_hits_tokens > sum(r.cached_tokens for r in requests)
    small.prefix_cache.check()


def test_without_the_cache_nothing_is_held_or_counted(make_engine, demo) -> None:
    engine = make_engine(prefix_cache=False)
    prompt = demo[2].encode(SYSTEM)
    run_waves(engine, [[prompt], [prompt]])
    stats = engine.stats
    assert engine.prefix_cache is None and not engine.pool.can_evict
    assert (stats.pool.cached_pages, stats.prefix_cached_pages) == (0, 0)
    assert (stats.prefix_queries_tokens, stats.prefix_hits_tokens) == (0, 0)
    assert stats.prefix_hit_ratio is None and stats.prefix_evictions_total == 0
    with pytest.raises(ValueError, match="prefix cache is off"):
        engine.set_eviction_policy("lfu")


def test_the_eviction_policy_is_validated_and_changes_at_run_time(make_engine) -> None:
    with pytest.raises(ValueError, match="eviction_policy must be one of lru, lfu, fifo"):
        EngineConfig(eviction_policy="mru")
    with pytest.raises(ValueError, match="prefix_isolation must be one of salt, sampling"):
        EngineConfig(prefix_isolation="tenant")
    engine = make_engine(eviction_policy="fifo")
    assert engine.prefix_cache.policy == "fifo"
    engine.set_eviction_policy("lfu")
    assert engine.prefix_cache.policy == "lfu"
    with pytest.raises(ValueError, match="unknown eviction policy"):
        engine.set_eviction_policy("random")


# seeds whose arrivals press the pool into preemption (the assertion below checks they still do)
@pytest.mark.parametrize("seed", [0, 2, 4])
def test_random_interleavings_keep_every_invariant_and_every_token(make_engine, demo, seed):
    """Requests with shared prefixes arrive at random moments into a pool too small for all of
    them (preemption, eviction), with defragmentation steps, explicit evictions, policy changes
    and resizes in between; every step keeps the pool's and the cache's invariants, and every
    request gets the tokens it gets without the cache in a pool large enough for all."""
    rng = random.Random(seed)
    tokenizer = demo[2]
    bases = [tokenizer.encode(text) for text in (SYSTEM, SYSTEM[:30] + "!", "Other tenant: ")]
    prompts = [
        rng.choice(bases)[: rng.randint(3, 22)] + [rng.randrange(40, 120)] * rng.randint(1, 5)
        for _ in range(12)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(2, 14), ignore_eos=True)
        for _ in prompts
    ]
    salts = [rng.choice([None, None, "t1"]) for _ in prompts]
    reference = make_engine(prefix_cache=False)
    alone = [reference.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    while reference.has_work():
        reference.step()
    expected = [r.output_ids for r in alone]

    engine = make_engine(page_size=rng.choice([3, 4]), pool_pages=16, segment_pages=8)
    requests: list[Request] = []
    while len(requests) < len(prompts) or engine.has_work():
        action = rng.random()
        if len(requests) < len(prompts) and action < 0.35:
            i = len(requests)
            requests.append(engine.add_request(prompts[i], params[i], cache_salt=salts[i]))
        elif action < 0.38:
            engine.defragmenter.step(rng.randint(1, 6))
        elif action < 0.43:
            engine.pool.evict(rng.randint(1, 6))
        elif action < 0.46:
            engine.set_eviction_policy(rng.choice(sorted(EVICTION_POLICIES)))
        elif action < 0.5:
            with contextlib.suppress(ResizeRefused):
                engine.resizer.resize(rng.choice([16, 24]))
        elif engine.has_work():
            engine.step()
        engine.pool.invariants.check()
        engine.prefix_cache.check()
    assert [r.output_ids for r in requests] == expected
    stats = engine.stats
    assert stats.preemptions > 0 and stats.prefix_hits_tokens > 0
    assert stats.prefix_evictions_total > 0
