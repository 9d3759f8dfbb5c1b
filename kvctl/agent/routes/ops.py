"""Operator routes: health, the pools and their maps, defrag, resize, alerts, settings, metrics.

An agent has one pool per served model. `/v1/pools/{name}/...` name one; the single-pool routes
(`/v1/pool`, `/v1/pool/map`, `/v1/defrag`, `/v1/pool/resize`) act on the only pool, and answer
409 naming the pools when there are several, rather than guess. Reads never wait on the engine:
`/healthz`, `/v1/pool(s)`, `/v1/alerts`, `/v1/config` and `/metrics` are served from the latest
published snapshots and settings, so monitoring keeps answering however busy the engine is.
A map takes a copy of the page states on the engine thread (a few memory copies) and does the
O(capacity) encoding on a worker thread.
Mutations go to the engine thread, are audited, and change nothing when refused.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from kvctl import __version__
from kvctl.agent.metrics import pools_registry, render
from kvctl.agent.model_pool import ModelPool
from kvctl.agent.pool import PoolError
from kvctl.agent.server import ApiError, ServerContext
from kvctl.agent.service import UnknownPool
from kvctl.alerts import AlertmanagerError
from kvctl.api import (
    AlertList,
    DefragRequest,
    DefragResult,
    ErrorBody,
    Health,
    ModelCard,
    ModelList,
    PoolList,
    PoolMap,
    PoolRelease,
    PoolSnapshot,
    ResizeRequest,
    ResizeResult,
    RuntimeSettings,
    RuntimeSettingsPatch,
    lone_surrogate,
)
from kvctl.settings import SettingsError

ERRORS = {code: {"model": ErrorBody} for code in (401, 404, 409, 422)}
POOL_REQUIRED = "pool_required"
"""The error `type` of a single-pool route on an agent serving several models (409)."""
UNKNOWN_POOL = "unknown_pool"
"""The error `type` of a named pool's route for a pool the agent does not have (404)."""


def router(ctx: ServerContext) -> APIRouter:
    api = APIRouter()
    service = ctx.service
    registry = pools_registry(
        lambda: [(p.snapshot, p.histograms) for p in service.pools.values() if p.snapshot],
        lambda: service.alerts,
        lambda: service.kv_events,
    )
    started_wall = time.time()

    def pool_of(name: str | None) -> ModelPool:
        """The named pool (404 naming those served), or the only one (409 when several)."""
        try:
            return service.pool(name)
        except UnknownPool as unknown:
            if name is None:
                message = f"{unknown}; name one: /v1/pools/NAME (kvctl: --pool NAME)"
                raise ApiError(409, message, error_type=POOL_REQUIRED) from None
            raise ApiError(404, str(unknown), error_type=UNKNOWN_POOL) from None

    @api.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        """Liveness: answers while the process serves HTTP, without a token."""
        return Health(
            status="ok",
            pool=service.pool_name,
            version=__version__,
            uptime_seconds=service.uptime(),
            pools=list(service.pools),
        )

    @api.get("/v1/pools", response_model=PoolList)
    async def pools() -> PoolList:
        """Every pool (one per served model) with the budget they share."""
        budget = service.budget
        return PoolList(
            pools=service.snapshots,
            budget_bytes=budget.total_bytes if budget else None,
            assigned_bytes=budget.assigned_bytes if budget else None,
        )

    @api.get("/v1/pool", response_model=PoolSnapshot, responses=ERRORS)
    async def pool() -> PoolSnapshot:
        """The latest snapshot of the only pool, its queue and counters (at most 100 ms old)."""
        return _snapshot(pool_of(None))

    @api.get("/v1/pools/{name}", response_model=PoolSnapshot, responses=ERRORS)
    async def named_pool(name: str) -> PoolSnapshot:
        """The latest snapshot of one model's pool."""
        return _snapshot(pool_of(name))

    async def page_map(name: str | None) -> PoolMap:
        target = pool_of(name)
        states, snapshot = await ctx.on_engine(
            lambda: service.page_states_and_snapshot(target.name)
        )
        runs = await asyncio.to_thread(states.runs)
        return PoolMap(
            capacity_pages=states.capacity,
            segment_pages=states.segment_pages,
            runs=[(r.state.value, r.start, r.length) for r in runs],
            pool=snapshot,
        )

    @api.get("/v1/pool/map", response_model=PoolMap, responses=ERRORS)
    async def pool_map() -> PoolMap:
        """Every page's state, run-length encoded, with the snapshot of the same moment."""
        return await page_map(None)

    @api.get("/v1/pools/{name}/map", response_model=PoolMap, responses=ERRORS)
    async def named_pool_map(name: str) -> PoolMap:
        """One pool's page states, run-length encoded, with its snapshot of the same moment."""
        return await page_map(name)

    async def defrag_pool(
        request: Request, body: DefragRequest | None, name: str | None
    ) -> DefragResult:
        target = pool_of(name)
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

    @api.post("/v1/defrag", response_model=DefragResult, responses=ERRORS)
    async def defrag(request: Request, body: DefragRequest | None = None) -> DefragResult:
        """Defragment the only pool now, to completion or `max_pages`, between two steps."""
        return await defrag_pool(request, body, None)

    @api.post("/v1/pools/{name}/defrag", response_model=DefragResult, responses=ERRORS)
    async def named_defrag(
        request: Request, name: str, body: DefragRequest | None = None
    ) -> DefragResult:
        """Defragment one model's pool now, to completion or `max_pages`."""
        return await defrag_pool(request, body, name)

    async def resize_pool(request: Request, body: ResizeRequest, name: str | None) -> ResizeResult:
        target = pool_of(name)
        snapshot = _snapshot(target)
        if body.tier == "device":
            per_page = snapshot.bytes_per_page
            pages = body.pages if body.pages is not None else -(-(body.bytes or 0) // per_page)
            run, refusals = (lambda: service.resize(pages, target.name)), (PoolError,)
        else:
            tier = next((t for t in snapshot.tiers if t.tier == body.tier), None)
            if tier is None:
                raise ApiError(
                    409,
                    f"this agent has no {body.tier} tier (start it with --host-tier-memory or "
                    "--disk-tier-path)",
                )
            pages = body.pages if body.pages is not None else (body.bytes or 0) // tier.page_bytes
            run = lambda: service.resize_tier(body.tier, pages, target.name)  # noqa: E731
            refusals = (ValueError,)
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

    @api.post("/v1/pool/resize", response_model=ResizeResult, responses=ERRORS)
    async def resize(request: Request, body: ResizeRequest) -> ResizeResult:
        """Grow or shrink the only pool in whole segments, or a host or disk tier in pages
        (`tier`); a refused resize changes nothing."""
        return await resize_pool(request, body, None)

    @api.post("/v1/pools/{name}/resize", response_model=ResizeResult, responses=ERRORS)
    async def named_resize(request: Request, name: str, body: ResizeRequest) -> ResizeResult:
        """Resize one model's pool (or its tier). In a shared budget the new size is pinned:
        the agent moves no memory in or out of the pool until it is released."""
        return await resize_pool(request, body, name)

    @api.post("/v1/pools/{name}/release", response_model=PoolRelease, responses=ERRORS)
    async def release(request: Request, name: str) -> PoolRelease:
        """Hand a pinned pool back to the agent, which may move memory in and out of it again."""
        target = pool_of(name)
        try:
            was_pinned = await ctx.on_engine(lambda: service.release(target.name))
        except ValueError as refused:
            ctx.audit_request(request, "release", "refused", pool=target.name, reason=str(refused))
            raise ApiError(409, str(refused)) from None
        ctx.audit_request(request, "release", "ok", pool=target.name, was_pinned=was_pinned)
        return PoolRelease(pool=target.name, was_pinned=was_pinned)

    @api.get("/v1/alerts", response_model=AlertList)
    async def alerts() -> AlertList:
        """The agent's own pending and firing alerts, with cause and remediation."""
        return AlertList(alerts=service.alerts)

    @api.post("/v1/alerts/test", responses=ERRORS)
    async def alert_test(request: Request) -> dict:
        """Send a test alert through this agent's own Alertmanager route and credentials."""
        alerting = service.alerting
        try:
            if alerting is None:
                raise AlertmanagerError("this agent evaluates no alerts")
            alert = await asyncio.to_thread(alerting.send_test)
        except AlertmanagerError as error:
            ctx.audit_request(request, "alert_test", "refused", reason=str(error))
            raise ApiError(409, str(error)) from None
        ctx.audit_request(request, "alert_test", "ok", labels=alert.get("labels", {}))
        return {"sent": True, "alert": alert}

    @api.get("/v1/config", response_model=RuntimeSettings)
    async def get_config() -> RuntimeSettings:
        """The runtime settings in force (docs/settings.md)."""
        return service.settings

    @api.patch(
        "/v1/config",
        response_model=RuntimeSettings,
        responses=ERRORS,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": RuntimeSettingsPatch.model_json_schema()}
                },
            }
        },
    )
    async def patch_config(request: Request) -> RuntimeSettings:
        """Change settings: a `{section: {name: value}}` object; `null` restores a default.
        Read as plain JSON and checked against kvctl.settings on the engine thread, so types
        stay strict and concurrent changes apply one after the other."""
        try:
            changes = json.loads(await request.body())
        except ValueError as error:
            raise ApiError(422, f"the body is not valid JSON: {error}") from None
        bad = lone_surrogate(changes)
        if bad is not None:
            raise ApiError(400, bad.message, param=bad.param)
        try:
            before, settings = await ctx.on_engine(lambda: service.change_settings(changes))
        except SettingsError as refused:
            ctx.audit_request(request, "config", "refused", reason=str(refused))
            raise ApiError(422, str(refused)) from None
        ctx.audit_request(request, "config", "ok", changed=_changed(before, settings))
        return settings

    @api.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        """The models this agent serves, OpenAI style: one card per served name (a model's
        first name is the one answers report, the others alias it, `root`), with what it
        supports and its context."""
        cards = [
            ModelCard(
                id=name,
                created=int(started_wall),
                root=served.name,
                capabilities=served.capabilities,
                max_model_len=served.context_length,
            )
            for served in (pool.served for pool in service.pools.values())
            for name in served.names
        ]
        return ModelList(data=cards)

    @api.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus text exposition of the snapshot (docs/metrics.md)."""
        payload, content_type = render(registry)
        return Response(payload, media_type=content_type)

    return api


def _snapshot(pool: ModelPool) -> PoolSnapshot:
    snapshot = pool.snapshot
    assert snapshot is not None  # published when the pool was added
    return snapshot


def _changed(before: RuntimeSettings, after: RuntimeSettings) -> dict[str, list[object]]:
    """`{"section.name": [old, new]}` for every setting that changed."""
    old, new = before.model_dump(), after.model_dump()
    return {
        f"{section}.{name}": [old[section][name], value]
        for section, values in new.items()
        for name, value in values.items()
        if old[section][name] != value
    }
