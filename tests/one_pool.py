"""An `AgentService` of one pool around an engine, for tests that drive the service without an
agent process: the pool's limits are the engine's own (its segment, its resizer's ceiling)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvctl.agent.config import DEFAULT_MAX_WAITING
from kvctl.agent.model_pool import ModelPool
from kvctl.agent.runtime import Engine
from kvctl.agent.service import AgentService
from kvctl.api import RuntimeSettings
from kvctl.settings import StartupLimits


def one_pool_service(
    engine: Engine,
    settings: RuntimeSettings | None = None,
    *,
    name: str = "demo",
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    window: float = 300.0,
    max_waiting: int = DEFAULT_MAX_WAITING,
) -> AgentService:
    limits = StartupLimits(
        engine.pool.segment_pages, engine.resizer.max_pages or engine.pool.capacity
    )
    pool = ModelPool(
        engine,
        name,
        limits,
        clock=clock,
        wall_clock=wall_clock,
        window=window,
        max_waiting=max_waiting,
    )
    return AgentService([pool], settings, clock=clock)
