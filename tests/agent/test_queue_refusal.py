"""A full queue is refused on the server's thread: the requests already on their way to the
engine thread count as waiting, so a flood gets its 429s as it arrives, not in one burst at the
engine's next step boundary (which held every scrape on the server's loop behind them)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest
from one_pool import one_pool_service

from kvctl.agent.model import SamplingParams
from kvctl.agent.service import AgentService, QueueFull
from kvctl.api import RuntimeSettings


def open_one(service: AgentService, loop: asyncio.AbstractEventLoop) -> Future:
    add = lambda engine: engine.add_request([1, 2, 3], SamplingParams())  # noqa: E731
    return service.open_stream(add, loop, service.pool("demo"))


def test_requests_beyond_max_waiting_are_refused_before_the_engine_thread_runs(
    make_engine,
) -> None:
    service = one_pool_service(make_engine(), RuntimeSettings(), max_waiting=2)
    loop = asyncio.new_event_loop()
    try:
        queued = [open_one(service, loop) for _ in range(2)]
        refused = open_one(service, loop)
        assert not any(f.done() for f in queued)  # no engine thread runs: they are on their way
        assert refused.done()
        with pytest.raises(QueueFull, match=r"^2 requests are waiting"):
            refused.result()
        assert service.pool("demo").rejected.read() == {"queue_full": 1}

        queued[0].cancel()  # a client that left frees its place in the count
        again = open_one(service, loop)
        assert not again.done()

        service.start()  # the engine thread queues the two still wanted
        streams = [queued[1].result(timeout=30), again.result(timeout=30)]
        assert len({s.request_id for s in streams}) == 2
        scheduler = service.pool("demo").engine.scheduler
        assert service.call(lambda: len(scheduler.waiting) <= 2).result(30)
    finally:
        service.stop(grace=0)
        loop.close()
