"""One thread owns the engine: while the agent's engine thread runs, engine-only methods called
from any other thread raise at once instead of racing the step; queued through
`AgentService.call` they run; once the engine thread has stopped, the caller may use them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from one_pool import one_pool_service

from kvctl.agent.model import SamplingParams
from kvctl.agent.model_pool import ModelPool
from kvctl.agent.runtime import Engine
from kvctl.agent.runtime.thread_owner import WrongThread
from kvctl.agent.service import AgentService
from kvctl.api import RuntimeSettings


@pytest.fixture
def running(make_engine) -> Iterator[AgentService]:
    service = one_pool_service(make_engine(), RuntimeSettings())
    service.start()
    try:
        yield service
    finally:
        service.stop(grace=0)


def pool_of(service: AgentService) -> ModelPool:
    return service.pool("demo")


def engine_of(service: AgentService) -> Engine:
    return pool_of(service).engine


ENGINE_ONLY = [
    ("Engine.step", lambda s: engine_of(s).step()),
    ("Engine.stats", lambda s: engine_of(s).stats),
    ("Engine.add_request", lambda s: engine_of(s).add_request([1, 2, 3], SamplingParams())),
    ("Engine.abort", lambda s: engine_of(s).abort("req-0")),
    ("Engine.set_eviction_policy", lambda s: engine_of(s).set_eviction_policy("lru")),
    ("ModelPool.resize", lambda s: pool_of(s).resize(64)),
    ("ModelPool.defrag_now", lambda s: pool_of(s).defrag_now(None)),
    ("ModelPool.page_states_and_snapshot", lambda s: pool_of(s).page_states_and_snapshot()),
    ("ModelPool.release", lambda s: pool_of(s).release()),
    ("ModelPool.resize_tier", lambda s: pool_of(s).resize_tier("host", 1)),
    ("AgentService.change_settings", lambda s: s.change_settings({})),
    ("AgentService.sleep", lambda s: s.sleep(pool_of(s), 1, force=True)),
    ("AgentService.wake", lambda s: s.wake(pool_of(s))),
    ("PrefixAdmin.listing", lambda s: s.prefix.listing(None)),
]


@pytest.mark.parametrize(("name", "call"), ENGINE_ONLY, ids=[n for n, _ in ENGINE_ONLY])
def test_engine_only_methods_refuse_another_thread(running, name, call) -> None:
    capacity = engine_of(running).pool.capacity
    with pytest.raises(WrongThread, match=rf"^{name} runs on the engine thread \(kvctl-engine\)"):
        call(running)
    assert engine_of(running).pool.capacity == capacity  # refused before it changed anything


def test_queued_on_the_engine_thread_they_run(running) -> None:
    result = running.call(lambda: pool_of(running).resize(64)).result(timeout=30)
    assert (result.old_pages, result.new_pages) == (256, 64)
    states, snapshot = running.call(pool_of(running).page_states_and_snapshot).result(timeout=30)
    assert states.capacity == snapshot.capacity_pages == 64


def test_after_the_engine_thread_stops_the_caller_owns_it(make_engine) -> None:
    service = one_pool_service(make_engine(), RuntimeSettings())
    service.start()
    service.stop(grace=0)
    assert pool_of(service).resize(64).new_pages == 64
    [request] = engine_of(service).generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert len(request.output_ids) == 2


def test_a_commands_effect_is_published_before_its_result_is_handed_over(running) -> None:
    """The routes answer from the latest snapshot, so a read right after a resize's answer must
    show the new size: the snapshot used to be published just after the result was handed
    over, and a quick reader could see the old size."""
    events: list[str] = []
    publish = running._publish_all

    def publishing() -> None:
        publish()
        events.append("published")

    running._publish_all = publishing  # type: ignore[method-assign]  # watch the order only

    def resize() -> object:
        events.append("ran")
        return pool_of(running).resize(64)

    future = running.call(resize)
    future.add_done_callback(lambda _: events.append("answered"))
    future.result(timeout=30)
    ran, answered = events.index("ran"), events.index("answered")
    assert "published" in events[ran:answered]
    assert running.pools["demo"].snapshot.capacity_pages == 64


def test_a_closed_loop_clients_replacements_are_prefilled_in_one_step(running, monkeypatch) -> None:
    """N streams that end together are replaced by N requests a few milliseconds apart (vLLM's
    benchmark client sends them 1-4 ms apart): the idle engine waits for all N rather than
    computing the first alone while the others wait a whole step for their first token. The
    gaps are scaled up here (50 ms arrivals, a 500 ms refill gap) so a busy machine cannot
    split the wave by chance; before, a gap over 3 ms split it."""
    import asyncio

    from kvctl.agent import service as service_module

    monkeypatch.setattr(service_module, "REFILL_GAP_S", 0.5, raising=False)
    monkeypatch.setattr(service_module, "REFILL_WINDOW_S", 5.0, raising=False)
    pool = running.pool("demo")

    def add(first: int):
        return lambda engine: engine.add_request(
            [first, 2, 3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True)
        )

    async def wave(first: int, gap: float) -> list[float | None]:
        loop = asyncio.get_running_loop()
        streams = []
        for n in range(4):
            await asyncio.sleep(gap if n else 0)
            streams.append(
                await asyncio.wrap_future(running.open_stream(add(first + n), loop, pool))
            )
        for stream in streams:
            while (await stream.events.get()).finish_reason is None:
                pass
        return [stream.request.first_admitted_at for stream in streams]

    async def two_waves() -> list[float | None]:
        await wave(10, 0.0)
        return await wave(20, 0.05)

    admitted = [at for at in asyncio.run(two_waves()) if at is not None]
    assert len(admitted) == 4
    assert max(admitted) - min(admitted) < 0.025, admitted  # one step, not one per arrival
