"""The agent's HTTP API (FastAPI): the application, its errors, and the checks every request
passes before a route sees it.

Routes live in `kvctl.agent.http.routes`, one router per resource; `ApiError` and the context they
share (`ServerContext`, a FastAPI dependency) live in `kvctl.agent.http.context`. Handlers
validate with the models of `kvctl.api`, then either read the service's latest snapshot or hand
a function to the engine thread and await its future: no handler touches the pool. Bad input
gets a 4xx with `{"error": {"message", "type", "param", "code"}}` and changes nothing.

Three ASGI layers wrap every route: `BodyLimit` refuses bodies over `--max-body-bytes` before they
are read, `TokenGate` requires the bearer token, when one is configured, on every path but
`/healthz` and `/runbook` (the static alert runbook): pool statistics and completions say what
other clients do, so reading them needs the token too; and `NestingLimit` refuses a body nested
deeper than `MAX_JSON_DEPTH` before anything parses it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvctl import __version__
from kvctl.agent.config import AgentConfig
from kvctl.agent.generation import Refusal
from kvctl.agent.http.audit import AuditLog, action_of
from kvctl.agent.http.context import ApiError, ServerContext, caller_of
from kvctl.agent.http.routes import (
    alerts,
    chat,
    completions,
    health,
    metrics,
    models,
    pools,
    prefix,
    runbook,
    settings,
    sleep,
    tokenize,
)
from kvctl.agent.service import AgentService
from kvctl.api import INVALID_TEXT, MAX_JSON_DEPTH, UNSUPPORTED, ErrorBody

log = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "unavailable",
}

ROUTERS = (
    health.router,
    pools.router,
    prefix.router,
    sleep.router,
    alerts.router,
    settings.router,
    models.router,
    metrics.router,
    completions.router,
    chat.router,
    tokenize.router,
    runbook.router,
)
"""Every route, one router per resource, in the order of /openapi.json and docs/api.md."""

OPEN_PATHS = frozenset({"/healthz", "/runbook"})
"""Paths served without the token: liveness, and the project's own static alert runbook."""


def _encodable(text: str) -> str:
    """`text` with any lone surrogate written as its escape: an error message may quote what
    the client sent, and a message that cannot be encoded would turn a 4xx into a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int,
    message: str,
    headers: Mapping[str, str] | None = None,
    error_type: str | None = None,
    param: str | None = None,
) -> JSONResponse:
    body = ErrorBody.model_validate(
        {
            "error": {
                "message": _encodable(message),
                "type": error_type or _ERROR_TYPES.get(status, "server_error"),
                "param": None if param is None else _encodable(param),
                "code": status,
            }
        }
    )
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body.model_dump(), status_code=status, headers=headers or None)


class BodyLimit:
    """Refuse request bodies over `limit` bytes with 413 before any handler reads them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(413, f"request body over {self.limit} bytes")(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise ApiError(413, f"request body over {self.limit} bytes")
            return message

        await self.app(scope, counted, send)


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
"""A JSON string, or an unterminated one to the end: every quote starts a match that cannot
fail, so the scan stays linear whatever the body (a pattern that could fail would rescan the
rest of the body from every later quote)."""
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in `body` (JSON), without parsing it, or 0 when it has
    too few brackets to nest past `MAX_JSON_DEPTH`: brackets inside strings are skipped, and the
    depth is the running count of opened minus closed brackets. Linear time in C (a regex, a
    byte filter and a cumulative sum), whatever the nesting."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # no deeper than the limit, whatever the structure
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps, dtype=np.int64).max())


class NestingLimit:
    """Refuse a body nested deeper than `MAX_JSON_DEPTH` with 400 as it is read, before any
    handler parses it: the JSON parser and the validators recurse once per level, and a body of
    100,000 `[` would exhaust the stack (a RecursionError) wherever it is parsed."""

    def __init__(self, app: ASGIApp, limit: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def checked() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    body = b"".join(chunks)
                    chunks.clear()
                    if json_depth(body) > self.limit:
                        raise ApiError(
                            400,
                            f"the body nests arrays and objects more than {self.limit} levels "
                            "deep; no request needs that many, so send a flatter body",
                        )
            return message

        await self.app(scope, checked, send)


class TokenGate:
    """Require `Authorization: Bearer <token>` (compared in constant time) on every path but
    `OPEN_PATHS`; a refused mutation is written to the audit trail."""

    def __init__(self, app: ASGIApp, token: str | None, audit: AuditLog) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.audit = audit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.token is None or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if authenticated(scope, self.token):
            await self.app(scope, receive, send)
            return
        action = action_of(scope["method"], scope["path"])
        if action is not None:
            self.audit.record(action, "unauthorized", caller_of(scope), False)
        message = "missing or wrong bearer token; pass --token or set KVCTL_TOKEN"
        await error_response(401, message)(scope, receive, send)


def authenticated(scope: Scope, token: bytes | None) -> bool:
    """Whether the request carries the token (always True when none is configured)."""
    if token is None:
        return True
    header = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, given = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given, token)


def _validation_error(error: RequestValidationError) -> tuple[int, str, str | None]:
    """A refused body's status, one-line message and field: 400 for a field the API knows and
    the agent does not implement, or for text that is not valid Unicode (their messages name
    the field), 422 for a body that breaks the schema."""
    errors = error.errors()
    first = next((e for e in errors if e["type"] in (UNSUPPORTED, INVALID_TEXT)), errors[0])
    where = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
    field = where if where != "body" else None
    if first["type"] == UNSUPPORTED:
        return 400, first["msg"], field
    if first["type"] == INVALID_TEXT:
        return 400, first["msg"], first.get("ctx", {}).get("param")
    if first["type"] == "json_invalid":
        cause = first.get("ctx", {}).get("error", first["msg"])
        return 422, f"the body is not valid JSON: {cause}", None
    return 422, f"{where}: {first['msg'].removeprefix('Value error, ')}", field


def create_app(
    service: AgentService,
    config: AgentConfig,
    on_ready: Callable[[], None] | None = None,
    run_engine: bool = True,
    advertised: str | None = None,
) -> FastAPI:
    """The FastAPI application serving `service`. With `run_engine`, starting and stopping the
    application starts and stops the engine thread; without, the caller runs the engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if run_engine:
            service.start()
        if on_ready is not None:
            on_ready()
        yield
        if run_engine:
            await asyncio.to_thread(service.stop, config.shutdown_grace)

    app = FastAPI(
        title="kvctl agent",
        version=__version__,
        description="Paged KV pool of one inference node: stats, defrag, resize, completions.",
        lifespan=lifespan,
    )
    audit = AuditLog(service.admin_actions)
    app.state.context = ServerContext(
        service, config, advertised or f"http://{config.host}:{config.port}", audit
    )
    app.add_middleware(NestingLimit)
    app.add_middleware(TokenGate, token=config.token, audit=audit)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)

    @app.exception_handler(StarletteHTTPException)  # also the router's own 404 and 405
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind, param = getattr(error, "error_type", None), getattr(error, "param", None)
        return error_response(error.status_code, str(error.detail), error.headers, kind, param)

    @app.exception_handler(Refusal)
    async def refused(_: Request, refusal: Refusal) -> JSONResponse:
        return error_response(
            refusal.status, refusal.message, refusal.headers, refusal.error_type, refusal.param
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        status, message, param = _validation_error(error)
        return error_response(status, message, param=param)

    @app.exception_handler(Exception)
    async def server_error(_: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(error).__name__}")

    for router in ROUTERS:
        app.include_router(router)
    return app
