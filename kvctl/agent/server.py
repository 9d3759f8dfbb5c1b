"""The agent's HTTP API (FastAPI), exactly the routes of DESIGN.md.

Handlers validate with the models of `kvctl.api`, then either read the service's latest snapshot
or hand a function to the engine thread and await its future: no handler touches the pool. Bad
input gets a 4xx with `{"error": {"message", "type", "code"}}` and changes nothing; mutating
routes need the bearer token when one is configured (compared in constant time).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvctl import __version__
from kvctl.agent.config import AgentConfig
from kvctl.agent.metrics import build_registry, render
from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.pool import PoolError
from kvctl.agent.runtime import Engine, TokenEvent
from kvctl.agent.runtime import Request as EngineRequest
from kvctl.agent.service import AgentService, RequestStream
from kvctl.api import (
    AlertList,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DefragRequest,
    DefragResult,
    ErrorBody,
    Health,
    ModelCard,
    ModelList,
    PoolMap,
    PoolSnapshot,
    PromptTokensDetails,
    ResizeRequest,
    ResizeResult,
    RuntimeSettings,
    RuntimeSettingsPatch,
    Usage,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "unauthorized",
    404: "not_found",
    409: "conflict",
    413: "request_too_large",
    422: "invalid_request_error",
    503: "unavailable",
}


class ApiError(HTTPException):
    """An HTTP error whose detail is a one-line message for the client."""


def error_response(status: int, message: str) -> JSONResponse:
    body = ErrorBody.model_validate(
        {
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "server_error"),
                "code": status,
            }
        }
    )
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


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


def _validation_message(error: RequestValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
    if first["type"] == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
    return f"{where}: {first['msg'].removeprefix('Value error, ')}"


def create_app(
    service: AgentService,
    config: AgentConfig,
    on_ready: Callable[[], None] | None = None,
    run_engine: bool = True,
) -> FastAPI:
    """The FastAPI application serving `service`. With `run_engine`, starting and stopping the
    application starts and stops the engine thread; without, the caller runs the engine."""
    started_wall = time.time()

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
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    registry = build_registry(lambda: service.snapshot, service.defrag_durations)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(422, _validation_message(error))

    @app.exception_handler(Exception)
    async def server_error(_: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(error).__name__}")

    def require_token(request: Request) -> None:
        if config.token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.encode(), config.token.encode()
        ):
            raise ApiError(401, "missing or wrong bearer token; pass --token or set KVCTL_TOKEN")

    async def on_engine(fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(service.call(fn))

    errors = {401: {"model": ErrorBody}, 409: {"model": ErrorBody}, 422: {"model": ErrorBody}}
    mutating = {"dependencies": [Depends(require_token)], "responses": errors}

    @app.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        return Health(
            status="ok",
            pool=service.pool_name,
            version=__version__,
            uptime_seconds=service.uptime(),
        )

    @app.get("/v1/pool", response_model=PoolSnapshot)
    async def pool() -> PoolSnapshot:
        return service.snapshot

    @app.get("/v1/pool/map", response_model=PoolMap)
    async def pool_map() -> PoolMap:
        def read() -> PoolMap:
            pool = service.engine.pool
            runs = [(r.state.value, r.start, r.length) for r in pool.page_map()]
            return PoolMap(
                capacity_pages=pool.capacity, segment_pages=pool.segment_pages, runs=runs
            )

        return await on_engine(read)

    @app.post("/v1/defrag", response_model=DefragResult, **mutating)
    async def defrag(body: DefragRequest | None = None) -> DefragResult:
        max_pages = body.max_pages if body else None
        return await on_engine(lambda: service.defrag_now(max_pages))

    @app.post("/v1/pool/resize", response_model=ResizeResult, **mutating)
    async def resize(body: ResizeRequest) -> ResizeResult:
        bytes_per_page = service.snapshot.bytes_per_page
        pages = body.pages if body.pages is not None else -(-(body.bytes or 0) // bytes_per_page)
        try:
            return await on_engine(lambda: service.resize(pages))
        except PoolError as refused:
            raise ApiError(409, f"resize refused: {refused}") from None

    @app.get("/v1/alerts", response_model=AlertList)
    async def alerts() -> AlertList:
        return AlertList(alerts=service.alerts)

    @app.get("/v1/config", response_model=RuntimeSettings)
    async def get_config() -> RuntimeSettings:
        return service.settings

    @app.patch("/v1/config", response_model=RuntimeSettings, **mutating)
    async def patch_config(body: RuntimeSettingsPatch) -> RuntimeSettings:
        merged = service.settings.model_dump()
        for section, changes in body.model_dump(exclude_none=True).items():
            merged[section].update(changes)
        try:
            settings = RuntimeSettings.model_validate(merged)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(422, f"{where}: {first['msg'].removeprefix('Value error, ')}") from None
        return await on_engine(lambda: service.update_settings(settings))

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=service.pool_name, created=int(started_wall))])

    @app.post("/v1/completions", response_model=CompletionResponse, **mutating)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if not service.accepting:
            raise ApiError(503, "the agent is shutting down")
        if body.model is not None and body.model != service.pool_name:
            raise ApiError(
                404,
                f"model {body.model!r} is not served here; this agent serves {service.pool_name!r}",
            )
        if body.max_tokens > config.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens {body.max_tokens} is above this agent's limit of "
                f"{config.max_tokens_limit}",
            )
        params = _sampling(body)
        loop = asyncio.get_running_loop()
        add = _adder(body, params, config.max_prompt_tokens)
        try:
            stream = await asyncio.wrap_future(service.open_stream(add, loop))
        except ValueError as error:
            raise ApiError(400, str(error)) from None
        if body.stream:
            return StreamingResponse(_sse(stream, body, service), media_type="text/event-stream")
        return JSONResponse((await _collect(stream, body, service)).model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        payload, content_type = render(registry)
        return Response(payload, media_type=content_type)

    return app


def _sampling(body: CompletionRequest) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            max_tokens=body.max_tokens,
            stop=stop,
            ignore_eos=body.ignore_eos,
        )
    except ValueError as error:
        raise ApiError(400, str(error)) from None


def _adder(
    body: CompletionRequest, params: SamplingParams, max_prompt: int
) -> Callable[[Engine], EngineRequest]:
    """The function that queues the request on the engine thread (where the tokenizer runs)."""
    request_id = f"cmpl-{uuid.uuid4().hex[:24]}"

    def add(engine: Engine) -> EngineRequest:
        prompt = body.prompt
        if isinstance(prompt, str) and engine.tokenizer is not None:
            prompt = engine.tokenizer.encode(prompt)
        if len(prompt) > max_prompt:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, over this agent's limit of {max_prompt}"
            )
        return engine.add_request(prompt, params, request_id=request_id, cache_salt=body.cache_salt)

    return add


def _usage(request: EngineRequest) -> Usage:
    prompt, completion = len(request.prompt_ids), len(request.output_ids)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=request.cached_tokens),
    )


async def _events(stream: RequestStream, service: AgentService) -> AsyncIterator[TokenEvent]:
    """The request's events until it finishes; abandoning the iteration aborts the request."""
    finished = False
    try:
        while not finished:
            event = await stream.events.get()
            finished = event.finish_reason is not None
            yield event
    finally:
        if not finished:
            service.abort(stream.request.request_id)


async def _collect(
    stream: RequestStream, body: CompletionRequest, service: AgentService
) -> CompletionResponse:
    text: list[str] = []
    reason = None
    async for event in _events(stream, service):
        text.append(event.text)
        reason = event.finish_reason
    request = stream.request
    choice = CompletionChoice(
        text="".join(text),
        finish_reason=reason.value if reason else None,
        token_ids=list(request.output_ids) if body.return_token_ids else None,
    )
    return CompletionResponse(
        id=request.request_id,
        created=int(time.time()),
        model=service.pool_name,
        choices=[choice],
        usage=_usage(request),
    )


async def _sse(
    stream: RequestStream, body: CompletionRequest, service: AgentService
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token, the last with the finish reason and usage."""
    request = stream.request
    created = int(time.time())
    async for event in _events(stream, service):
        choice: dict[str, Any] = {
            "index": 0,
            "text": event.text,
            "finish_reason": event.finish_reason.value if event.finish_reason else None,
            "logprobs": None,
        }
        if body.return_token_ids:
            choice["token_ids"] = [] if event.token_id is None else [event.token_id]
        chunk: dict[str, Any] = {
            "id": request.request_id,
            "object": "text_completion",
            "created": created,
            "model": service.pool_name,
            "choices": [choice],
        }
        if event.finish_reason is not None:
            chunk["usage"] = _usage(request).model_dump()
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
