"""The pools: their snapshots and maps, defrag, resize and release.

An agent has one pool per served model. `/v1/pools/{name}/...` name one; the single-pool routes
(`/v1/pool`, `/v1/pool/map`, `/v1/defrag`, `/v1/pool/resize`) act on the only pool, and answer
409 naming the pools when there are several, rather than guess. Reads never wait on the engine:
`/v1/pool(s)` are served from the latest published snapshots. A map takes a copy of the page
states on the engine thread (a few memory copies) and does the O(capacity) encoding on a worker
thread. Every action is the pool's own (`ModelPool`): the route finds the pool and runs the
action on the engine thread (`ctx.on_engine`); it is audited, and changes nothing when refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import APIRouter, Request

from kvctl.agent.http.context import ERRORS, ApiError, Context, ServerContext
from kvctl.agent.model_pool import ModelPool, ResizeRefusal
from kvctl.agent.service import AgentService, UnknownPool
from kvctl.api import (
    POOL_REQUIRED,
    UNKNOWN_POOL,
    DefragRequest,
    DefragResult,
    PoolList,
    PoolMap,
    PoolRelease,
    PoolSnapshot,
    ResizeRequest,
    ResizeResult,
)

router = APIRouter()


def pool_of(service: AgentService, name: str | None) -> ModelPool:
    """The named pool (404 naming those served), or the only one (409 when several)."""
    try:
        return service.pool(name)
    except UnknownPool as unknown:
        if name is None:
            message = f"{unknown}; name one: /v1/pools/NAME (kvctl: --pool NAME)"
            raise ApiError(409, message, error_type=POOL_REQUIRED) from None
        raise ApiError(404, str(unknown), error_type=UNKNOWN_POOL) from None


def snapshot_of(pool: ModelPool) -> PoolSnapshot:
    """The pool's latest snapshot (the service publishes one when it is built)."""
    snapshot = pool.snapshot
    if snapshot is None:
        raise ApiError(503, f"pool {pool.name} has published no reading yet; retry")
    return snapshot


@router.get("/v1/pools", response_model=PoolList)
async def pools(ctx: Context) -> PoolList:
    """Every pool (one per served model) with the budget they share."""
    budget = ctx.service.budget
    return PoolList(
        pools=ctx.service.snapshots,
        budget_bytes=budget.total_bytes if budget else None,
        assigned_bytes=budget.assigned_bytes if budget else None,
    )


@router.get("/v1/pool", response_model=PoolSnapshot, responses=ERRORS)
async def pool(ctx: Context) -> PoolSnapshot:
    """The latest snapshot of the only pool, its queue and counters (at most 100 ms old)."""
    return snapshot_of(pool_of(ctx.service, None))


@router.get("/v1/pools/{name}", response_model=PoolSnapshot, responses=ERRORS)
async def named_pool(name: str, ctx: Context) -> PoolSnapshot:
    """The latest snapshot of one model's pool."""
    return snapshot_of(pool_of(ctx.service, name))


async def page_map(ctx: ServerContext, name: str | None) -> PoolMap:
    target = pool_of(ctx.service, name)
    states, snapshot = await ctx.on_engine(target.page_states_and_snapshot)
    runs = await asyncio.to_thread(states.runs)
    return PoolMap(
        capacity_pages=states.capacity,
        segment_pages=states.segment_pages,
        runs=[(r.state.value, r.start, r.length) for r in runs],
        pool=snapshot,
    )


@router.get("/v1/pool/map", response_model=PoolMap, responses=ERRORS)
async def pool_map(ctx: Context) -> PoolMap:
    """Every page's state, run-length encoded, with the snapshot of the same moment."""
    return await page_map(ctx, None)


@router.get("/v1/pools/{name}/map", response_model=PoolMap, responses=ERRORS)
async def named_pool_map(name: str, ctx: Context) -> PoolMap:
    """One pool's page states, run-length encoded, with its snapshot of the same moment."""
    return await page_map(ctx, name)


async def defrag_pool(
    ctx: ServerContext, request: Request, body: DefragRequest | None, name: str | None
) -> DefragResult:
    target = pool_of(ctx.service, name)
    max_pages = body.max_pages if body else None
    result = await ctx.on_engine(lambda: target.defrag_now(max_pages))
    ctx.audit_request(
        request,
        "defrag",
        "ok",
        pool=target.name,
        max_pages=max_pages,
        pages_moved=result.pages_moved,
        fragmentation_before=result.fragmentation_before,
        fragmentation_after=result.fragmentation_after,
    )
    return result


@router.post("/v1/defrag", response_model=DefragResult, responses=ERRORS)
async def defrag(request: Request, ctx: Context, body: DefragRequest | None = None) -> DefragResult:
    """Defragment the only pool now, to completion or `max_pages`, between two steps."""
    return await defrag_pool(ctx, request, body, None)


@router.post("/v1/pools/{name}/defrag", response_model=DefragResult, responses=ERRORS)
async def named_defrag(
    request: Request, name: str, ctx: Context, body: DefragRequest | None = None
) -> DefragResult:
    """Defragment one model's pool now, to completion or `max_pages`."""
    return await defrag_pool(ctx, request, body, name)


def resize_command(
    target: ModelPool, body: ResizeRequest
) -> tuple[int, Callable[[], ResizeResult], tuple[type[Exception], ...]]:
    """The pages `body` asks for, the pool's action that resizes to them, and the errors that
    mean a refusal: the device pool in whole segments (`bytes` rounded up to a page), a host or
    disk tier in pages (`bytes` rounded down); 409 for a tier the pool does not have."""
    snapshot = snapshot_of(target)
    if body.tier == "device":
        per_page = snapshot.bytes_per_page
        pages = body.pages if body.pages is not None else -(-(body.bytes or 0) // per_page)
        return pages, lambda: target.resize(pages), (ResizeRefusal,)
    tier = next((t for t in snapshot.tiers if t.tier == body.tier), None)
    if tier is None:
        raise ApiError(
            409,
            f"this agent has no {body.tier} tier (start it with --host-tier-memory or "
            "--disk-tier-path)",
        )
    pages = body.pages if body.pages is not None else (body.bytes or 0) // tier.page_bytes
    return pages, lambda: target.resize_tier(body.tier, pages), (ValueError,)


async def resize_pool(
    ctx: ServerContext, request: Request, body: ResizeRequest, name: str | None
) -> ResizeResult:
    target = pool_of(ctx.service, name)
    pages, run, refusals = resize_command(target, body)
    try:
        result = await ctx.on_engine(run)
    except refusals as refused:
        ctx.audit_request(
            request,
            "resize",
            "refused",
            pool=target.name,
            tier=body.tier,
            pages=pages,
            reason=str(refused),
        )
        raise ApiError(409, f"resize refused: {refused}") from None
    ctx.audit_request(
        request,
        "resize",
        "ok",
        pool=target.name,
        tier=body.tier,
        old_pages=result.old_pages,
        new_pages=result.new_pages,
        pages_moved=result.pages_moved,
        pages_evicted=result.pages_evicted,
        pinned=result.pinned,
    )
    return result


@router.post("/v1/pool/resize", response_model=ResizeResult, responses=ERRORS)
async def resize(request: Request, body: ResizeRequest, ctx: Context) -> ResizeResult:
    """Grow or shrink the only pool in whole segments, or a host or disk tier in pages
    (`tier`); a refused resize changes nothing."""
    return await resize_pool(ctx, request, body, None)


@router.post("/v1/pools/{name}/resize", response_model=ResizeResult, responses=ERRORS)
async def named_resize(
    request: Request, name: str, body: ResizeRequest, ctx: Context
) -> ResizeResult:
    """Resize one model's pool (or its tier). In a shared budget the new size is pinned:
    the agent moves no memory in or out of the pool until it is released."""
    return await resize_pool(ctx, request, body, name)


@router.post("/v1/pools/{name}/release", response_model=PoolRelease, responses=ERRORS)
async def release(request: Request, name: str, ctx: Context) -> PoolRelease:
    """Hand a pinned pool back to the agent, which may move memory in and out of it again."""
    target = pool_of(ctx.service, name)
    try:
        was_pinned = await ctx.on_engine(target.release)
    except ValueError as refused:
        ctx.audit_request(request, "release", "refused", pool=target.name, reason=str(refused))
        raise ApiError(409, str(refused)) from None
    ctx.audit_request(request, "release", "ok", pool=target.name, was_pinned=was_pinned)
    return PoolRelease(pool=target.name, was_pinned=was_pinned)
