"""The prefix cache's operations: look a prompt up, pin and unpin a prefix, list, clear.

`POST /v1/prefix/lookup` says how much of a prompt (text, a chat or token ids, in a cache
salt's partition) a model's pool holds on the device and in each tier; `POST /v1/prefix/pins`
keeps the cached part on the device through any eviction (optionally for `ttl_s`; with `warm`,
computing the prompt first when it is not cached whole), within the
`prefix_cache.max_pinned_share` cap; `DELETE /v1/prefix/pins/{id}` lets it go; `GET /v1/prefix`
lists the pins and the largest cached prefixes; `POST /v1/prefix/move` brings a prefix to the
device before a known burst, or stores a copy in the host tier; `POST /v1/prefix/clear` forgets
one salt's or every partition, of one model or all, on the device and in the tiers (a purge:
nothing moves down a tier). Prompts are tokenized as the generation routes do, so what a lookup
finds is what the same request would reuse. Pins, unpins, moves and clears are audited; a refusal
changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request

from kvctl.agent.chat_prompt import prompt_ids
from kvctl.agent.generation import Generation, Refusal
from kvctl.agent.http.context import ERRORS, ApiError, Context, ServerContext
from kvctl.agent.http.routes.generation import disconnected
from kvctl.agent.http.routes.pools import pool_of
from kvctl.agent.model_pool import ModelPool
from kvctl.agent.prefix_admin import PrefixOpRefused, UnknownPin, UnknownSalt
from kvctl.api import (
    UNKNOWN_PREFIX_ITEM,
    ChatCompletionRequest,
    PrefixClearRequest,
    PrefixClearResult,
    PrefixListing,
    PrefixLookupResult,
    PrefixMoveRequest,
    PrefixPinRequest,
    PrefixPinView,
    PrefixQuery,
)

T = TypeVar("T")
router = APIRouter()
PREFIX_ERRORS = {400: ERRORS[409]} | ERRORS


async def query_ids(ctx: ServerContext, pool: ModelPool, body: PrefixQuery) -> list[int]:
    """The query's prompt as the model's token ids (400 for one the model cannot read)."""
    gen = Generation(ctx, "prefix", pool)
    if body.token_ids is not None:
        gen.check_vocabulary(body.token_ids, "token_ids")
        ids = list(body.token_ids)
    elif body.prompt is not None:
        ids = await gen.tokenize(body.prompt)
    else:
        assert body.messages is not None
        chat = ChatCompletionRequest(
            model=pool.name, messages=body.messages, add_generation_prompt=False
        )
        ids = await prompt_ids(gen, chat)
    if not ids:
        raise ApiError(400, "the prompt has no tokens")
    gen.check_length(ids)
    return ids


async def warm(
    ctx: ServerContext, request: Request, pool: ModelPool, ids: list[int], salt: str | None
) -> None:
    """Compute the prompt as a one-token request in `salt`'s partition, so that its pages are
    cached when it ends (a refusal, such as a full queue, as the generation routes answer; a
    client that leaves first has the request aborted, as they do)."""
    try:
        stream = await Generation(ctx, "prefix", pool).warm(ids, salt)
    except Refusal as refused:
        raise ApiError(refused.status, refused.message) from None

    async def finished() -> None:
        while (await stream.events.get()).finish_reason is None:
            pass

    done, gone = asyncio.ensure_future(finished()), asyncio.ensure_future(disconnected(request))
    await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not done.done():
        done.cancel()
        ctx.service.abort(stream.request_id)
        raise ApiError(499, "the client left before the prompt was computed; nothing was pinned")
    gone.cancel()


async def on_engine_refusing(ctx: ServerContext, fn: Callable[[], T]) -> T:
    """Run a prefix command on the engine thread; its refusals as one-line HTTP errors."""
    try:
        return await ctx.on_engine(fn)
    except (UnknownPin, UnknownSalt) as unknown:
        message = str(unknown).strip("'\"")
        raise ApiError(404, message, error_type=UNKNOWN_PREFIX_ITEM) from None
    except PrefixOpRefused as refused:
        raise ApiError(409, str(refused)) from None


@router.post("/v1/prefix/lookup", response_model=PrefixLookupResult, responses=PREFIX_ERRORS)
async def lookup(body: PrefixQuery, ctx: Context) -> PrefixLookupResult:
    """How much of the prompt the model's pool holds, on the device and in each tier."""
    pool = pool_of(ctx.service, body.model)
    ids = await query_ids(ctx, pool, body)
    admin = ctx.service.prefix
    return await on_engine_refusing(ctx, lambda: admin.lookup(pool.name, body.cache_salt, ids))


@router.get("/v1/prefix", response_model=PrefixListing, responses=ERRORS)
async def listing(ctx: Context, model: str | None = None) -> PrefixListing:
    """The pins and the largest cached prefixes, of one model or every model."""
    name = None if model is None else pool_of(ctx.service, model).name
    admin = ctx.service.prefix
    return await on_engine_refusing(ctx, lambda: admin.listing(name))


@router.post(
    "/v1/prefix/pins", response_model=PrefixPinView, status_code=201, responses=PREFIX_ERRORS
)
async def pin(request: Request, body: PrefixPinRequest, ctx: Context) -> PrefixPinView:
    """Keep the cached part of the prompt on the device (for `ttl_s`, or until unpinned)."""
    pool = pool_of(ctx.service, body.model)
    ids = await query_ids(ctx, pool, body)
    admin, salt = ctx.service.prefix, body.cache_salt
    try:
        if body.warm:
            found = await on_engine_refusing(ctx, lambda: admin.lookup(pool.name, salt, ids))
            whole = len(ids) // pool.engine.pool.page_size * pool.engine.pool.page_size
            if found.device_tokens < whole:
                await warm(ctx, request, pool, ids, salt)
        view = await on_engine_refusing(ctx, lambda: admin.pin(pool.name, salt, ids, body.ttl_s))
    except ApiError as refused:
        ctx.audit_request(
            request, "prefix_pin", "refused", pool=pool.name, salt=salt, reason=refused.detail
        )
        raise
    ctx.audit_request(
        request,
        "prefix_pin",
        "ok",
        pool=pool.name,
        salt=salt,
        pin=view.id,
        tokens=view.tokens,
        pages=view.pages,
        ttl_s=body.ttl_s,
    )
    return view


@router.post("/v1/prefix/move", response_model=PrefixLookupResult, responses=PREFIX_ERRORS)
async def move(request: Request, body: PrefixMoveRequest, ctx: Context) -> PrefixLookupResult:
    """Bring the prompt's prefix to the device before a known burst (computed, or loaded from a
    tier, as its one-token request is), or store a copy of the device's pages in the host tier;
    the lookup after it."""
    pool = pool_of(ctx.service, body.model)
    ids = await query_ids(ctx, pool, body)
    admin, salt = ctx.service.prefix, body.cache_salt
    try:
        if body.to == "device":
            await warm(ctx, request, pool, ids, salt)
        else:
            await on_engine_refusing(ctx, lambda: admin.store_below(pool.name, salt, ids, body.to))
        found = await on_engine_refusing(ctx, lambda: admin.lookup(pool.name, salt, ids))
    except ApiError as refused:
        ctx.audit_request(
            request, "prefix_move", "refused", pool=pool.name, to=body.to, reason=refused.detail
        )
        raise
    ctx.audit_request(request, "prefix_move", "ok", pool=pool.name, salt=salt, to=body.to)
    return found


@router.delete("/v1/prefix/pins/{pin_id}", response_model=PrefixPinView, responses=ERRORS)
async def unpin(request: Request, pin_id: str, ctx: Context) -> PrefixPinView:
    """Let a pin go: its pages stay cached, evictable again."""
    admin = ctx.service.prefix
    try:
        view = await on_engine_refusing(ctx, lambda: admin.unpin(pin_id))
    except ApiError as refused:
        ctx.audit_request(request, "prefix_unpin", "refused", pin=pin_id, reason=refused.detail)
        raise
    ctx.audit_request(request, "prefix_unpin", "ok", pool=view.model, pin=pin_id)
    return view


@router.post("/v1/prefix/clear", response_model=PrefixClearResult, responses=ERRORS)
async def clear(request: Request, body: PrefixClearRequest, ctx: Context) -> PrefixClearResult:
    """Forget cached prefixes and their pins: one model or all, one salt or all, one place or
    all (a purge: nothing moves down a tier)."""
    name = None if body.model is None else pool_of(ctx.service, body.model).name
    admin = ctx.service.prefix
    details = {"model": name, "salt": body.cache_salt, "tier": body.tier}
    try:
        result = await on_engine_refusing(
            ctx, lambda: admin.clear(name, body.cache_salt, body.tier)
        )
    except ApiError as refused:
        ctx.audit_request(request, "prefix_clear", "refused", **details, reason=refused.detail)
        raise
    ctx.audit_request(
        request,
        "prefix_clear",
        "ok",
        **details,
        pages_freed=result.pages_freed,
        pins_removed=result.pins_removed,
    )
    return result
