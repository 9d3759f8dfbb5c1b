"""Sleeping and waking a model on the agent's engine thread: the KV pool's memory leaves the pool
(and its storage) and goes to the budget, where another pool can grow into it; a wake, by hand or
by a request, brings the pool back, taking back what was borrowed of its share; the tokens after
a wake are the tokens before a sleep, at both levels; and every refusal changes nothing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from sleeping_models import (
    GREEDY,
    PROMPT,
    SEGMENT,
    budgeted,
    generate,
    model_pool,
    on_engine,
    open_greedy,
    slow_reload,
    slow_to_wake,
    wake,
)

from kvctl.agent.model_sleep import SleepRefused
from kvctl.agent.service import AgentService
from kvctl.api import RuntimeSettings


@pytest.fixture
def two_models(make_engine) -> Iterator[AgentService]:
    service = budgeted(make_engine)
    service.start()
    try:
        yield service
    finally:
        service.stop(grace=0)


def test_a_sleeping_model_releases_its_pool_to_the_budget(two_models) -> None:
    service = two_models
    budget = service.budget
    assert budget is not None
    a = service.pool("a")
    page = a.engine.pool.bytes_per_page
    before = budget.unassigned_bytes
    result = on_engine(service, lambda: service.sleep(service.pool("a"), 1))
    assert result.kv_bytes == 128 * page and result.level == 1 and result.trigger == "manual"
    assert budget.unassigned_bytes == before + 128 * page
    assert a.engine.storage.num_segments == 0 and a.engine.storage.nbytes == 0
    snapshot = a.snapshot
    assert snapshot is not None and snapshot.capacity_pages == 0 and snapshot.segments == 0
    assert snapshot.sleep.state == "asleep" and snapshot.sleep.level == 1
    assert snapshot.sleep.released_bytes == 128 * page
    assert budget.reachable_pages("b") == (128 + 128 + SEGMENT) // SEGMENT * SEGMENT  # all of it
    budget.check()


def test_the_other_pool_grows_into_the_released_memory_and_gives_it_back_on_wake(
    two_models,
) -> None:
    service = two_models
    budget = service.budget
    assert budget is not None
    on_engine(service, lambda: service.sleep(service.pool("a"), 1))
    b = service.pool("b").engine
    on_engine(service, lambda: service.pool("b").engine.resizer.resize(128 + 128 + SEGMENT))
    assert b.pool.capacity == 288 and budget.unassigned_bytes == 0
    woken = wake(service, "a").result(timeout=60)
    assert woken.woke and woken.level == 1 and woken.trigger == "manual"
    a = service.pool("a").engine
    assert a.pool.capacity == woken.capacity_pages == 128  # its share, taken back from b
    assert b.pool.capacity == 128 + SEGMENT
    assert a.storage.num_pages == a.pool.capacity
    budget.check()
    snapshot = service.pool("a").snapshot
    assert snapshot is not None and snapshot.sleep.state == "awake"
    assert snapshot.sleep.wakes_total["manual"] == 1 and snapshot.sleep.last_wake_seconds
    assert service.pool("a").histograms.wake.read().count == 1


@pytest.mark.parametrize("level", [1, 2])
def test_a_request_wakes_the_model_and_gets_the_tokens_it_got_before(two_models, level) -> None:
    service = two_models
    before = generate(service, "a")
    on_engine(service, lambda: service.sleep(service.pool("a"), level))
    engine = service.pool("a").engine
    assert engine.weights_loaded == (level == 1)
    if engine.device.type != "cpu":  # on a GPU, asleep at level 1 the weights are in host memory
        assert engine.weights_bytes(engine.device) == 0
    after = generate(service, "a")
    assert after == before
    snapshot = service.pool("a").snapshot
    assert snapshot is not None and snapshot.sleep.state == "awake"
    assert snapshot.sleep.wakes_total == {"manual": 0, "request": 1}
    assert service.pool("a").engine.pool.capacity == 128


def test_a_level_two_wake_that_cannot_load_its_weights_ends_the_waiting_requests(
    make_engine,
) -> None:
    loaded = threading.Event()

    def broken() -> torch.nn.Module:
        loaded.set()
        raise OSError("model.safetensors: No such file or directory")

    engines = [make_engine(), make_engine()]
    service = AgentService([model_pool(engines[0], "a", broken), model_pool(engines[1], "b")])
    service.start()
    try:
        on_engine(service, lambda: service.sleep(service.pool("a"), 2))
        tokens = generate(service, "a")
        assert tokens == [] and loaded.is_set()
        a = service.pool("a")
        assert a.sleep.level == 2 and not a.sleep.waking
        assert a.engine.storage.num_segments == 0  # asleep again: nothing held
        assert "No such file" in (a.sleep.last_wake_error or "")
        with pytest.raises(SleepRefused, match="could not reload its weights"):
            wake(service, "a").result(timeout=60)
        assert generate(service, "b")  # the other model served throughout
    finally:
        service.stop(grace=0)


def test_refusals_change_nothing(make_engine) -> None:
    engines = [make_engine(), make_engine()]
    service = AgentService([model_pool(engines[0], "a", reload=None), model_pool(engines[1], "b")])
    service.start()
    try:
        with pytest.raises(SleepRefused, match="no checkpoint to reload"):
            on_engine(service, lambda: service.sleep(service.pool("a"), 2))
        on_engine(service, lambda: service.sleep(service.pool("a"), 1))
        with pytest.raises(SleepRefused, match="already asleep at level 1"):
            on_engine(service, lambda: service.sleep(service.pool("a"), 1))
        with pytest.raises(SleepRefused, match="last awake model"):
            on_engine(service, lambda: service.sleep(service.pool("b"), 1))
        b = service.pool("b").engine
        assert b.pool.capacity == 256 and b.storage.num_pages == 256
        on_engine(service, lambda: service.sleep(service.pool("b"), 1, force=True))
        assert b.storage.num_pages == 0
        assert generate(service, "b")  # a request wakes even the last model
    finally:
        service.stop(grace=0)


def test_a_model_with_requests_or_pins_does_not_sleep(make_engine) -> None:
    engine = make_engine(prefix_cache=True)
    service = AgentService([model_pool(engine, "a"), model_pool(make_engine(), "b")])
    # not started: this thread is the engine thread
    engine.add_request(PROMPT, GREEDY)
    with pytest.raises(SleepRefused, match="0 requests running and 1 waiting"):
        service.sleep(service.pool("a"), 1)
    while engine.has_work():
        engine.step()
    service.prefix.pin("a", None, PROMPT, None)
    with pytest.raises(SleepRefused, match="1 pinned prefixes"):
        service.sleep(service.pool("a"), 1)
    assert engine.storage.num_pages == engine.pool.capacity == 256
    engine.pool.invariants.check()


def test_an_idle_model_falls_asleep_by_itself_but_never_the_last(make_engine) -> None:
    settings = RuntimeSettings.model_validate({"sleep": {"idle_s": 1.0, "level": 2}})
    service = budgeted(make_engine, settings)
    service.start()
    try:
        generate(service, "b")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            asleep = [p.name for p in service.pools.values() if not p.sleep.awake]
            if asleep:
                break
            time.sleep(0.1)
        time.sleep(2.5)  # long enough for the second to fall asleep too, were it allowed to
        asleep = [p.name for p in service.pools.values() if not p.sleep.awake]
        assert len(asleep) == 1
        snapshot = service.pool(asleep[0]).snapshot
        assert snapshot is not None and snapshot.sleep.sleeps_total["idle"] == 1
        assert snapshot.sleep.level == 2
    finally:
        service.stop(grace=0)


def test_a_sleeping_pools_map_has_no_pages(two_models) -> None:
    service = two_models
    on_engine(service, lambda: service.sleep(service.pool("a"), 1))
    states, snapshot = on_engine(service, service.pool("a").page_states_and_snapshot)
    assert states.capacity == snapshot.capacity_pages == 0 and states.runs() == []
    wake(service, "a").result(timeout=60)
    states, snapshot = on_engine(service, service.pool("a").page_states_and_snapshot)
    assert states.capacity == snapshot.capacity_pages == 128


def test_a_client_that_leaves_during_a_wake_leaves_nothing_behind(make_engine) -> None:
    loading, release = threading.Event(), threading.Event()
    service = slow_to_wake(make_engine, slow_reload(loading, release))
    try:

        async def leave() -> None:
            loop = asyncio.get_running_loop()
            stream = await asyncio.wrap_future(open_greedy(service, "a", loop))
            service.abort(stream.request_id)

        asyncio.run(leave())
        assert loading.wait(30)
        a = service.pool("a")
        assert a.sleep.waking
        release.set()
        assert wake(service, "a").result(timeout=60).woke
        held = on_engine(service, lambda: (len(a.engine.requests), a.engine.pool.used_pages))
        assert held == (0, 0)
        on_engine(service, a.engine.pool.invariants.check)
        assert generate(service, "a")
    finally:
        release.set()
        service.stop(grace=0)


def test_an_agent_stopping_during_a_wake_ends_the_waiting_requests(make_engine) -> None:
    loading, release = threading.Event(), threading.Event()
    service = slow_to_wake(make_engine, slow_reload(loading, release))
    ended: list[str | None] = []
    try:

        async def wait_then_stop() -> None:
            loop = asyncio.get_running_loop()
            stream = await asyncio.wrap_future(open_greedy(service, "a", loop))
            assert await asyncio.to_thread(loading.wait, 30)
            await asyncio.to_thread(service.stop, 0)
            event = await asyncio.wait_for(stream.events.get(), timeout=30)
            ended.append(event.finish_reason)

        stopping = threading.Thread(target=asyncio.run, args=(wait_then_stop(),))
        stopping.start()
        assert loading.wait(30)
        time.sleep(0.5)  # the stop is under way: it waits for the reload to end
        assert stopping.is_alive()
        release.set()
        stopping.join(60)
        assert ended == ["abort"]
    finally:
        release.set()
        service.stop(grace=0)
