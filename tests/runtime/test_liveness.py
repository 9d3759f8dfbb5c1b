"""Liveness under memory pressure: every step with work makes progress, a request that can never
fit is refused at arrival, and every admitted request runs to its own end.

The engine runs the demo model on tiny pools with the prefix cache on, where the old scheduler
could sit forever with requests waiting, nothing running and the pool full of cached pages."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.agent.model import SamplingParams
from kvctl.agent.pool import ResizeRefused
from kvctl.agent.runtime import Engine, FinishReason, Request, RequestTooLarge


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def step_checked(engine: Engine) -> list:
    """One step; it must make progress whenever there is work (a token, an end, or a chunk of a
    prompt computed), and keep the pool sound."""
    had_work = engine.has_work()
    scheduler = engine.scheduler
    computed = {r: r.num_computed for r in (*scheduler.running, *scheduler.waiting)}
    events = engine.step()
    engine.pool.invariants.check()
    if engine.prefix_cache is not None:
        engine.prefix_cache.check()
    if had_work:
        advanced = any(r.num_computed > c for r, c in computed.items() if not r.finished)
        assert events or advanced, (
            f"no progress: {len(engine.scheduler.waiting)} waiting, "
            f"{len(engine.scheduler.running)} running, {engine.pool.stats()}"
        )
    return events


def test_a_cached_partial_page_does_not_block_a_request_that_fills_the_pool(make_engine):
    # 8 pages of 4 tokens. A leaves 3 whole pages cached; B shares A's first 10 tokens (2 whole
    # pages and half of a third) and its 31 tokens need all 8 pages. Adopting the half page
    # would need a 9th page for its copy: B must take the 2 whole pages and compute the rest.
    engine = make_engine(page_size=4, pool_pages=8, segment_pages=8)
    shared = list(range(1, 11))
    first = engine.add_request([*shared, 50, 51], greedy(1))
    while engine.has_work():
        step_checked(engine)
    assert engine.pool.cached_pages == 3 and engine.pool.free_pages == 5
    second = engine.add_request([*shared, *range(100, 121)], greedy(1))
    for _ in range(10):
        if not engine.has_work():
            break
        step_checked(engine)
    assert second.finish_reason is FinishReason.LENGTH and len(second.output_ids) == 1
    assert first.finish_reason is FinishReason.LENGTH


def test_a_request_that_can_never_fit_is_refused_at_arrival(make_engine):
    engine = make_engine(page_size=4, pool_pages=8, segment_pages=8, max_pool_pages=16)
    before = engine.pool.stats()
    with pytest.raises(RequestTooLarge) as refused:
        engine.add_request(list(range(1, 31)), greedy(10))  # 40 tokens: 10 pages of 8
    message = refused.value.describe("kvctl --agent http://node:8477")
    assert "needs 10 pages of 4 tokens and the pool holds 8" in message
    assert "`kvctl --agent http://node:8477 pool resize --pages 16`" in message
    with pytest.raises(RequestTooLarge, match=r"at most 16 after growth.*--max-pool-pages 20"):
        engine.add_request(list(range(1, 71)), greedy(10))  # 80 tokens: 20 pages
    assert not engine.has_work() and engine.pool.stats() == before
    # exactly the pool fits, and runs to max_tokens
    fits = engine.add_request(list(range(1, 23)), greedy(10))
    while engine.has_work():
        step_checked(engine)
    assert fits.finish_reason is FinishReason.LENGTH and len(fits.output_ids) == 10


def test_a_shrink_below_what_an_admitted_request_needs_is_refused(make_engine):
    engine = make_engine(page_size=4, pool_pages=16, segment_pages=4)
    request = engine.add_request(list(range(1, 9)), greedy(40))  # may need 12 pages
    step_checked(engine)
    with pytest.raises(ResizeRefused, match="may need 12 pages to finish"):
        engine.resizer.resize(8)
    assert engine.pool.capacity == 16
    engine.resizer.resize(12)  # exactly enough
    while engine.has_work():
        step_checked(engine)
    assert request.finish_reason is FinishReason.LENGTH and len(request.output_ids) == 40


def test_the_same_tokens_whatever_the_pressure(make_engine):
    """Preemption and recomputation under a tiny pool never change a request's greedy tokens."""
    prompts = [[1 + (i * 7 + j) % 200 for j in range(6 + 3 * i)] for i in range(5)]
    roomy = make_engine(page_size=4, pool_pages=256, segment_pages=32, prefix_cache=False)
    expected = [r.output_ids for r in roomy.generate(prompts, greedy(12))]
    tight = make_engine(page_size=4, pool_pages=8, segment_pages=8)
    requests = [tight.add_request(p, greedy(12)) for p in prompts]
    while tight.has_work():
        step_checked(tight)
    assert [r.output_ids for r in requests] == expected
    assert tight.scheduler.preemptions > 0


SHARED = [list(range(1, 1 + n)) for n in (3, 6, 9, 13)]
"""Prompt prefixes that end mid-page for every page size drawn, so prefix matches often end in
a partly matched page (the case that needs a page more for its copy)."""


def prompt_of(prefix: int, suffix_len: int, seed: int) -> list[int]:
    """A shared prefix, then tokens that differ between seeds right after it."""
    return SHARED[prefix] + [20 + (seed * 31 + j * 7) % 230 for j in range(suffix_len)]


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([2, 3, 4]))
    pages = draw(st.integers(6, 12))
    budget = draw(st.sampled_from([512, 2, 5]))  # tokens per step: 2 and 5 chunk most prompts
    arrival = st.tuples(
        st.just("add"),
        st.sampled_from(range(len(SHARED))),
        st.one_of(st.integers(0, 12), st.just("fill")),  # "fill": prompt + max_tokens = pool
        st.integers(1, 24),
        st.integers(0, 3),
    )
    actions = draw(
        st.lists(
            st.one_of(
                arrival,
                st.tuples(st.just("step"), st.integers(1, 6)),
                st.tuples(st.just("abort"), st.integers(0, 50)),
                st.tuples(st.just("resize"), st.integers(1, 4)),
            ),
            min_size=4,
            max_size=30,
        )
    )
    return page_size, pages, budget, actions


def add_checked(engine, page_size: int, action: tuple, admitted: list[Request]) -> None:
    """Add one request of a random workload; one too large for any pool is refused at once."""
    _, prefix, suffix_len, max_tokens, seed = action
    if suffix_len == "fill":
        max_tokens = 1 + max_tokens % 3
        suffix_len = engine.pool.capacity * page_size - max_tokens - len(SHARED[prefix])
    prompt = prompt_of(prefix, max(0, suffix_len), seed)
    try:
        admitted.append(engine.add_request(prompt, greedy(max_tokens)))
    except RequestTooLarge:
        need = engine.pool.pages_for(len(prompt) + max_tokens)
        assert need > engine.pool.capacity


@pytest.mark.slow
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_random_workloads_on_tiny_pools_always_progress(make_engine, workload):
    """Random arrivals (with shared prefixes), aborts and resizes on pools of 4-12 pages, with
    budgets that cut prompts into chunks of 1-5 tokens or none: every
    step with work makes progress, refusals happen at arrival and say why, and every request
    ends by its own rule — `length` exactly at max_tokens, `abort` when aborted, never cut."""
    page_size, pages, budget, actions = workload
    engine = make_engine(
        page_size=page_size,
        pool_pages=pages,
        segment_pages=1,
        max_pool_pages=2 * pages,
        max_batched_tokens=budget,
        max_batch_seqs=min(budget, 64),
    )
    admitted: list[Request] = []
    aborted: set[str] = set()
    for action in actions:
        if action[0] == "add":
            add_checked(engine, page_size, action, admitted)
        elif action[0] == "step":
            for _ in range(action[1]):
                step_checked(engine)
        elif action[0] == "abort":
            live = [r for r in admitted if not r.finished]
            if live:
                victim = live[action[1] % len(live)]
                engine.abort(victim.request_id)
                aborted.add(victim.request_id)
        else:
            with contextlib.suppress(ResizeRefused):
                engine.resizer.resize(action[1] * pages // 2)
    for _ in range(5000):
        if not engine.has_work():
            break
        step_checked(engine)
    assert not engine.has_work()
    for request in admitted:
        if request.request_id in aborted:
            assert request.finish_reason is FinishReason.ABORT
        else:
            assert request.finish_reason is FinishReason.LENGTH
            assert len(request.output_ids) == request.params.max_tokens
    assert engine.pool.used_pages == 0


def test_a_request_waiting_for_its_pool_to_grow_does_not_hold_up_smaller_ones(make_engine):
    """In a budget shared with other pools a request may need more pages than its pool holds
    now: it waits for memory, and the small requests behind it run meanwhile. Once the pool
    holds it, it is first again and later arrivals do not pass it."""
    engine = make_engine(page_size=4, pool_pages=8, segment_pages=8, max_pool_pages=32)
    engine.scheduler.reachable_pages = lambda: 32  # another pool could give it memory
    large = engine.add_request(list(range(1, 51)), greedy(10))  # 60 tokens: 15 pages
    small = engine.add_request([1, 2, 3], greedy(4))
    for _ in range(8):
        if not small.finished:
            step_checked(engine)
    assert small.finish_reason is FinishReason.LENGTH and len(small.output_ids) == 4
    assert engine.step() == []  # nothing can run until the pool grows
    assert not large.finished and large in engine.scheduler.waiting
    engine.resizer.resize(24)  # the memory arrives
    later = engine.add_request([5, 6, 7], greedy(2))
    step_checked(engine)
    running = engine.scheduler.running
    assert large in running, "the large request lost its place"
    while engine.has_work():
        step_checked(engine)
    assert large.finish_reason is FinishReason.LENGTH and len(large.output_ids) == 10
    assert later.finish_reason is FinishReason.LENGTH


def test_preempting_to_fit_frees_the_youngest_requests_pages_first(make_engine):
    engine = make_engine(page_size=4, pool_pages=16, segment_pages=4)
    first = engine.add_request(list(range(1, 20)), greedy(4))  # 5 pages
    second = engine.add_request(list(range(30, 49)), greedy(4))
    step_checked(engine)
    assert engine.pool.used_pages >= 10
    assert engine.scheduler.preempt_to_fit(8) == 1
    assert second in engine.scheduler.waiting and first in engine.scheduler.running
    assert engine.pool.used_pages <= 8
    engine.resizer.resize(8)  # the shrink it made room for
    while engine.has_work():
        step_checked(engine)
    assert first.finish_reason is second.finish_reason is FinishReason.LENGTH
