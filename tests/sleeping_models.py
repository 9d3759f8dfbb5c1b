"""Two demo models on an `AgentService`, with a reload for level-2 sleeps, and a request sent
the way the HTTP routes send one: for the tests of sleeping and waking models."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch.nn import Module

from kvctl.agent.budget import KvBudget
from kvctl.agent.model import SamplingParams, build_demo_model
from kvctl.agent.model_pool import ModelPool
from kvctl.agent.runtime import Engine
from kvctl.agent.service import AgentService, RequestStream
from kvctl.api import RuntimeSettings, WakeResult
from kvctl.settings import StartupLimits
from tests.kv_device import DEVICE

PROMPT = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEGMENT = 32


def reload_demo() -> torch.nn.Module:
    """The demo model built again from its seed, as the agent reloads it."""
    return build_demo_model(DEVICE, torch.float32, seed=0)[1]


def model_pool(engine: Engine, name: str, reload: Callable | None = reload_demo) -> ModelPool:
    limits = StartupLimits(SEGMENT, engine.resizer.max_pages or 4 * engine.pool.capacity)
    return ModelPool(engine, name, limits, reload=reload)


def budgeted(make_engine, settings: RuntimeSettings | None = None) -> AgentService:
    """Two demo pools of 128 pages (a and b) under a budget with one segment unassigned."""
    engines = {name: make_engine(pool_pages=128, max_pool_pages=512) for name in ("a", "b")}
    service = AgentService([model_pool(e, n) for n, e in engines.items()], settings)
    page = engines["a"].pool.bytes_per_page
    budget = KvBudget((128 + 128 + SEGMENT) * page)
    for name, engine in engines.items():
        budget.add(name, engine.resizer)
    service.share_budget(budget)
    return service


def on_engine(service: AgentService, fn: Callable):
    return service.call(fn).result(timeout=60)


def wake(service: AgentService, model: str) -> Future[WakeResult]:
    """Wake `model` as the wake route does: started on the engine thread; the future is done
    once the model can step."""
    return on_engine(service, lambda: service.wake(service.pool(model)))


def open_greedy(
    service: AgentService, model: str, loop: asyncio.AbstractEventLoop, prompt: list[int] = PROMPT
) -> Future[RequestStream]:
    """A greedy request for `model` through the service, as the HTTP routes send one."""
    return service.open_stream(
        lambda engine: engine.add_request(prompt, GREEDY), loop, service.pool(model)
    )


async def tokens_of(stream: RequestStream) -> list[int]:
    """The stream's tokens, until its request ends."""
    tokens = []
    while True:
        event = await asyncio.wait_for(stream.events.get(), timeout=120)
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.finish_reason is not None:
            return tokens


def generate(service: AgentService, model: str, prompt: list[int] = PROMPT) -> list[int]:
    """A greedy request through the service; its tokens."""

    async def run() -> list[int]:
        loop = asyncio.get_running_loop()
        return await tokens_of(await asyncio.wrap_future(open_greedy(service, model, loop, prompt)))

    return asyncio.run(run())


def slow_reload(loading: threading.Event, release: threading.Event) -> Callable[[], Module]:
    """A reload that waits for `release` (a checkpoint read that takes its time)."""

    def reload() -> Module:
        loading.set()
        assert release.wait(60)
        return reload_demo()

    return reload


def slow_to_wake(make_engine: Callable[..., Engine], reload: Callable[[], Module]) -> AgentService:
    """Two demo models, a (reloaded by `reload`) and b, started, a asleep at level 2."""
    engines = [make_engine(), make_engine()]
    service = AgentService([model_pool(engines[0], "a", reload), model_pool(engines[1], "b")])
    service.start()
    on_engine(service, lambda: service.sleep(service.pool("a"), 2))
    return service
