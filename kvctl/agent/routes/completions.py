"""`POST /v1/completions`: OpenAI-compatible completions, plain and streamed.

Every limit is checked before the work it protects: `max_tokens` and the stop strings by the
request model, a text prompt's size in bytes before it is tokenized (a prompt of many times the
model's context can only be refused, so it is never turned into a token list), tokenizing on a
worker thread one prompt at a time (the engine thread never waits on it), and the queue's length
on the engine thread. A refusal says what was exceeded and what to do: 429 with `Retry-After`
when the queue is full, 400 naming the pages needed and the resize that would make room when a
request could never fit, 503 while the agent drains.

A client that goes away is noticed: a stream ends when its connection does, and a plain request
watches its connection while it waits, so its request is aborted and its pages released instead
of running to the end for nobody.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.routes.ops import ERRORS
from kvctl.agent.runtime import (
    Engine,
    RequestRefused,
    RequestSummary,
    RequestTooLarge,
    TokenEvent,
)
from kvctl.agent.runtime import Request as EngineRequest
from kvctl.agent.server import ApiError, ServerContext
from kvctl.agent.service import QueueFull, RequestStream, ShuttingDown
from kvctl.api import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)

MAX_BYTES_PER_TOKEN = 16
"""A text prompt longer than this many bytes per token of its limit is refused untokenized:
tokenizers average 1 (byte-level) to about 4-5 bytes per token on text and code, so such a
prompt is far over the limit anyway, and tokenizing it would only cost memory."""
RETRY_AFTER_S = 1
"""`Retry-After` of a 429: a slot in the queue opens as soon as one request is admitted."""


def router(ctx: ServerContext) -> APIRouter:
    api = APIRouter()
    service, config = ctx.service, ctx.config
    tokenizing = asyncio.Semaphore(1)

    def refuse(status: int, reason: str, message: str) -> ApiError:
        service.rejected.add(reason)
        return ApiError(status, message)

    async def prompt_ids(body: CompletionRequest) -> list[int]:
        """The prompt as token ids, refused before tokenizing when its text is too long."""
        limit = min(config.max_prompt_tokens, service.engine.model_config.max_context_len)
        prompt = body.prompt
        if isinstance(prompt, list):
            ids = prompt
        else:
            tokenizer = service.engine.tokenizer
            if tokenizer is None:
                raise refuse(400, "invalid", "this model has no tokenizer: send token ids")
            size, byte_limit = len(prompt.encode("utf-8")), limit * MAX_BYTES_PER_TOKEN
            if size > byte_limit:
                raise refuse(
                    400,
                    "invalid",
                    f"the prompt is {size} bytes, over this agent's limit of {byte_limit} "
                    f"({MAX_BYTES_PER_TOKEN} bytes per token of a {limit}-token prompt); "
                    "shorten it",
                )
            async with tokenizing:
                ids = await asyncio.to_thread(tokenizer.encode, prompt)
        if len(ids) > limit:
            raise refuse(
                400,
                "invalid",
                f"the prompt has {len(ids)} tokens, over this agent's limit of {limit}",
            )
        return ids

    async def queue(body: CompletionRequest, ids: list[int]) -> RequestStream:
        params = _sampling(body)
        add = _adder(ids, params, body.cache_salt)
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wrap_future(service.open_stream(add, loop))
        except QueueFull as full:
            raise ApiError(429, str(full), {"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDown as draining:
            raise ApiError(503, str(draining)) from None
        except RequestTooLarge as large:
            raise ApiError(400, large.describe(ctx.kvctl)) from None
        except RequestRefused as refused:
            raise ApiError(400, str(refused)) from None
        except ValueError as invalid:
            service.rejected.add("invalid")
            raise ApiError(400, str(invalid)) from None

    @api.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**ERRORS, 429: ERRORS[409], 503: ERRORS[409]},
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI completions, streamed as server-sent events with `stream: true`."""
        if not service.accepting:
            raise refuse(503, "shutting_down", "the agent is shutting down")
        if body.model is not None and body.model != service.pool_name:
            raise ApiError(
                404,
                f"model {body.model!r} is not served here; this agent serves {service.pool_name!r}",
            )
        if body.max_tokens > config.max_tokens_limit:
            raise refuse(
                400,
                "invalid",
                f"max_tokens {body.max_tokens} is above this agent's limit of "
                f"{config.max_tokens_limit}",
            )
        stream = await queue(body, await prompt_ids(body))
        usage = _usage_of(config.report_cached_tokens)
        if body.stream:
            return StreamingResponse(_sse(stream, body, ctx, usage), media_type="text/event-stream")
        collecting = asyncio.ensure_future(_collect(stream, body, ctx, usage))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collecting.done():  # the client left: stop its request, free its pages
            collecting.cancel()
            await asyncio.gather(collecting, return_exceptions=True)
            return Response(status_code=499)
        gone.cancel()
        return JSONResponse(collecting.result().model_dump())

    return api


async def _disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
    ids: Sequence[int], params: SamplingParams, cache_salt: str | None
) -> Callable[[Engine], EngineRequest]:
    """The function that queues the request on the engine thread."""
    request_id = f"cmpl-{uuid.uuid4().hex[:24]}"

    def add(engine: Engine) -> EngineRequest:
        return engine.add_request(ids, params, request_id=request_id, cache_salt=cache_salt)

    return add


def _usage_of(report_cached: bool) -> Callable[[RequestSummary], Usage]:
    """OpenAI's usage block; `cached_tokens` only when the operator opted in, because it tells
    a client whether others sent the same prompt prefix (docs/security.md)."""

    def usage(summary: RequestSummary) -> Usage:
        prompt, completion = summary.prompt_tokens, len(summary.output_ids)
        details = PromptTokensDetails(cached_tokens=summary.cached_tokens)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details if report_cached else None,
        )

    return usage


async def _events(stream: RequestStream, ctx: ServerContext) -> AsyncIterator[TokenEvent]:
    """The request's events until it finishes; abandoning the iteration aborts the request."""
    finished = False
    try:
        while not finished:
            event = await stream.events.get()
            finished = event.finish_reason is not None
            yield event
    finally:
        if not finished:
            ctx.service.abort(stream.request_id)


async def _collect(
    stream: RequestStream,
    body: CompletionRequest,
    ctx: ServerContext,
    usage: Callable[[RequestSummary], Usage],
) -> CompletionResponse:
    text: list[str] = []
    last = None
    async for event in _events(stream, ctx):
        text.append(event.text)
        last = event
    assert last is not None and last.summary is not None, "a finished request has a summary"
    summary = last.summary
    reason = last.finish_reason
    choice = CompletionChoice(
        text="".join(text),
        finish_reason=reason.value if reason else None,
        token_ids=list(summary.output_ids) if body.return_token_ids else None,
        finish_detail=summary.finish_detail,
    )
    return CompletionResponse(
        id=stream.request_id,
        created=int(time.time()),
        model=ctx.service.pool_name,
        choices=[choice],
        usage=usage(summary),
    )


async def _sse(
    stream: RequestStream,
    body: CompletionRequest,
    ctx: ServerContext,
    usage: Callable[[RequestSummary], Usage],
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token, the last with the finish reason and usage."""
    created = int(time.time())
    async for event in _events(stream, ctx):
        choice: dict[str, Any] = {
            "index": 0,
            "text": event.text,
            "finish_reason": event.finish_reason.value if event.finish_reason else None,
            "logprobs": None,
        }
        if body.return_token_ids:
            choice["token_ids"] = [] if event.token_id is None else [event.token_id]
        chunk: dict[str, Any] = {
            "id": stream.request_id,
            "object": "text_completion",
            "created": created,
            "model": ctx.service.pool_name,
            "choices": [choice],
        }
        if event.finish_reason is not None and event.summary is not None:
            if event.summary.finish_detail:
                choice["finish_detail"] = event.summary.finish_detail
            chunk["usage"] = usage(event.summary).model_dump(exclude_none=True)
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
