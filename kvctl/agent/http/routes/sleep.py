"""Putting a model to sleep and waking it: `POST /v1/pools/{name}/sleep` and `.../wake`.

A sleep releases the model's KV pool to the budget (level 1 keeps its weights in host memory,
level 2 drops them); a wake, or the next request for the model, brings them back. Both are
audited; a refusal (requests in flight, pins, the last awake model without `force`, already
asleep) is a 409 that changes nothing. A wake answers once the model can step, with how long it
took; one that fails (no room for the pool, a checkpoint that cannot be read) is a 409 and the
model sleeps on.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from kvctl.agent.http.context import ERRORS, ApiError, Context
from kvctl.agent.http.routes.pools import pool_of
from kvctl.agent.model_sleep import SleepRefused
from kvctl.api import SleepRequest, SleepResult, WakeResult

router = APIRouter()


@router.post("/v1/pools/{name}/sleep", response_model=SleepResult, responses=ERRORS)
async def sleep(
    request: Request, name: str, ctx: Context, body: SleepRequest | None = None
) -> SleepResult:
    """Release the model's KV pool (and at level 2 its weights) until it wakes."""
    target = pool_of(ctx.service, name)
    body = body or SleepRequest()
    details = {"pool": target.name, "level": body.level, "force": body.force}
    try:
        result = await ctx.on_engine(
            lambda: ctx.service.sleep(target, body.level, force=body.force)
        )
    except SleepRefused as refused:
        ctx.audit_request(request, "sleep", "refused", **details, reason=str(refused))
        raise ApiError(409, str(refused)) from None
    ctx.audit_request(
        request, "sleep", "ok", **details, kv_bytes=result.kv_bytes, weights=result.weights_bytes
    )
    return result


@router.post("/v1/pools/{name}/wake", response_model=WakeResult, responses=ERRORS)
async def wake(request: Request, name: str, ctx: Context) -> WakeResult:
    """Wake the model; answers once it can step (at once when it is awake)."""
    target = pool_of(ctx.service, name)
    try:
        woken = await ctx.on_engine(lambda: ctx.service.wake(target))
        result = await asyncio.wrap_future(woken)
    except SleepRefused as refused:
        ctx.audit_request(request, "wake", "refused", pool=target.name, reason=str(refused))
        raise ApiError(409, str(refused)) from None
    ctx.audit_request(
        request, "wake", "ok", pool=target.name, woke=result.woke, seconds=result.wake_seconds
    )
    return result
