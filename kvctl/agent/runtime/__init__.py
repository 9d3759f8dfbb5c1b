"""The agent's runtime: requests, the continuous-batching scheduler, the paged attention backend
and the engine whose `step()` ties them to the model and the pool."""

from kvctl.agent.runtime.engine import (
    Engine,
    EngineConfig,
    EngineStats,
    RequestRefused,
    RequestSummary,
    RequestTooLarge,
    TokenEvent,
)
from kvctl.agent.runtime.paged_cache import PagedKVCache
from kvctl.agent.runtime.request import FinishReason, Request, RequestStatus
from kvctl.agent.runtime.scheduler import ScheduledBatch, Scheduler

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "PagedKVCache",
    "Request",
    "RequestRefused",
    "RequestStatus",
    "RequestSummary",
    "RequestTooLarge",
    "ScheduledBatch",
    "Scheduler",
    "TokenEvent",
]
