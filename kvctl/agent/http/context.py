"""What the HTTP side shares: the error a handler raises, and the context every route reads.

Its own module so that `server` (which wires the application) and `routes` (which serve it)
both import it and neither imports the other's internals: the context reaches a handler as a
FastAPI dependency (`Context`, read from `app.state`), so a handler is a plain module-level
function that a test can call with a context of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, HTTPException, Request
from prometheus_client import CollectorRegistry
from starlette.types import Scope

from kvctl.agent.config import AgentConfig
from kvctl.agent.http.audit import Action, AuditLog, Outcome
from kvctl.agent.observe.metrics import pools_registry
from kvctl.agent.service import AgentService
from kvctl.api import ErrorBody

T = TypeVar("T")

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (401, 404, 409, 422)
}
"""The error answers routes declare (for /openapi.json), all in OpenAI's shape."""


class ApiError(HTTPException):
    """An HTTP error whose detail is a one-line message for the client; `error_type` names the
    case for clients that act on it (`pool_required`, `unknown_pool`), else the status's;
    `param` names the request field at fault, where there is one."""

    def __init__(
        self,
        status_code: int,
        detail: str,
        headers: dict[str, str] | None = None,
        error_type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(status_code, detail, headers)
        self.error_type = error_type
        self.param = param


def caller_of(scope: Scope) -> str:
    """The client's address as `host:port` (what the audit trail records)."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "unknown"


@dataclass
class ServerContext:
    """What the routes share: the service, the configuration, the agent's advertised URL (for
    the commands in error messages) and the audit trail; and, one per application, when it
    started, its metrics registry and the lock that tokenizes one text at a time."""

    service: AgentService
    config: AgentConfig
    advertised: str
    audit: AuditLog
    started_wall: float = field(default_factory=time.time)
    registry: CollectorRegistry = field(init=False, repr=False)
    tokenizing: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(1), init=False, repr=False
    )
    """Every route tokenizes a text under it, on a worker thread: one text at a time, whatever
    the number of requests and routes, so memory and the worker stay bounded."""

    def __post_init__(self) -> None:
        service = self.service
        self.registry = pools_registry(
            lambda: [(p.snapshot, p.histograms) for p in service.pools.values() if p.snapshot],
            lambda: service.alerts,
            lambda: service.kv_events,
        )

    @property
    def kvctl(self) -> str:
        """The CLI command that reaches this agent, for remediation text."""
        return f"kvctl --agent {self.advertised}"

    async def on_engine(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between two steps and await its result."""
        return await asyncio.wrap_future(self.service.call(fn))

    def audit_request(
        self, request: Request, action: Action, outcome: Outcome, **details: object
    ) -> None:
        """Audit a mutation a route carried out or refused (TokenGate has checked the token
        whenever one is configured, so the caller is authenticated exactly then)."""
        authenticated = self.config.token is not None
        self.audit.record(action, outcome, caller_of(request.scope), authenticated, details)


def context(request: Request) -> ServerContext:
    """The application's context (`create_app` puts it in `app.state`)."""
    return request.app.state.context


Context = Annotated[ServerContext, Depends(context)]
"""A handler's parameter type for the context, resolved per request by FastAPI."""
