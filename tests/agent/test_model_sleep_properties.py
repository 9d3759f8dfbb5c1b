"""Sleeps, wakes and requests in any order, on two models sharing a KV budget: after every
step the budget holds (no pool outside its bounds, the pools within the budget), an awake pool's
storage holds exactly its pages and a sleeping one's none, every pool keeps its invariants, and
every request gets the tokens its model gave before anything slept. Requests racing a sleep are
either served (the sleep refused) or wake the model; none is lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sleeping_models import budgeted, generate, on_engine, open_greedy, tokens_of, wake

from kvctl.agent.model_sleep import SleepRefused
from kvctl.agent.service import AgentService

MODELS = ("a", "b")
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("sleep"), st.sampled_from(MODELS), st.sampled_from((1, 2))),
        st.tuples(st.just("wake"), st.sampled_from(MODELS), st.just(0)),
        st.tuples(st.just("generate"), st.sampled_from(MODELS), st.just(0)),
        st.tuples(st.just("race"), st.sampled_from(MODELS), st.sampled_from((1, 2))),
    ),
    min_size=1,
    max_size=8,
)


def check(service: AgentService) -> None:
    """The budget, every pool's invariants, and storage that matches each pool's state."""

    def on_thread() -> None:
        assert service.budget is not None
        service.budget.check()
        for pool in service.pools.values():
            engine = pool.engine
            engine.pool.invariants.check()
            if pool.sleep.awake:
                assert engine.storage.num_pages == engine.pool.capacity
                assert engine.weights_loaded
            elif not pool.sleep.waking:
                assert engine.storage.num_pages == 0
                assert pool.member is not None and pool.member.asleep

    on_engine(service, on_thread)


def race(service: AgentService, model: str, level: int) -> list[int]:
    """A sleep and a request sent together: the sleep is refused (the request got there first)
    or the request wakes the model; either way it gets its tokens."""

    async def run() -> list[int]:
        loop = asyncio.get_running_loop()
        slept = service.call(lambda: service.sleep(service.pool(model), level, force=True))
        tokens = await tokens_of(await asyncio.wrap_future(open_greedy(service, model, loop)))
        try:
            await asyncio.wrap_future(slept)
        except SleepRefused as refused:  # the request was first, or it slept already
            assert "requests running" in str(refused) or "already asleep" in str(refused)
        return tokens

    return asyncio.run(run())


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=STEPS)
def test_any_order_of_sleeps_wakes_and_requests_keeps_the_budget_and_the_tokens(
    make_engine, steps
) -> None:
    service = budgeted(make_engine)
    service.start()
    try:
        expected = generate(service, "a")  # both models are the demo model
        actions: dict[str, Callable[[str, int], object]] = {
            "sleep": lambda model, level: _sleep(service, model, level),
            "wake": lambda model, _: wake(service, model).result(timeout=120),
            "generate": lambda model, _: _served(generate(service, model), expected),
            "race": lambda model, level: _served(race(service, model, level), expected),
        }
        for action, model, level in steps:
            actions[action](model, level)
            check(service)
        for model in MODELS:  # whatever sleeps still serves
            _served(generate(service, model), expected)
        check(service)
    finally:
        service.stop(grace=0)


def _sleep(service: AgentService, model: str, level: int) -> None:
    try:
        on_engine(service, lambda: service.sleep(service.pool(model), level, force=True))
    except SleepRefused as refused:
        assert "already asleep" in str(refused)


def _served(tokens: list[int], expected: list[int]) -> None:
    assert tokens == expected
