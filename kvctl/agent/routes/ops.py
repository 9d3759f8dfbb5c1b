"""Operator routes: health, the pool and its map, defrag, resize, alerts, settings, metrics.

Reads never wait on the engine: `/healthz`, `/v1/pool`, `/v1/alerts`, `/v1/config` and
`/metrics` are served from the latest published snapshot and settings, so monitoring keeps
answering however busy the engine is. `/v1/pool/map` takes a copy of the page states on the
engine thread (a few memory copies) and does the O(capacity) encoding on a worker thread.
Mutations go to the engine thread, are audited, and change nothing when refused.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from kvctl import __version__
from kvctl.agent.metrics import build_registry, render
from kvctl.agent.pool import PoolError
from kvctl.agent.server import ApiError, ServerContext
from kvctl.alerts import AlertmanagerError
from kvctl.api import (
    AlertList,
    DefragRequest,
    DefragResult,
    ErrorBody,
    Health,
    ModelCard,
    ModelList,
    PoolMap,
    PoolSnapshot,
    ResizeRequest,
    ResizeResult,
    RuntimeSettings,
    RuntimeSettingsPatch,
)
from kvctl.settings import SettingsError

ERRORS = {code: {"model": ErrorBody} for code in (401, 409, 422)}


def router(ctx: ServerContext) -> APIRouter:
    api = APIRouter()
    service = ctx.service
    registry = build_registry(lambda: service.snapshot, service.histograms)
    started_wall = time.time()

    @api.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        """Liveness: answers while the process serves HTTP, without a token."""
        return Health(
            status="ok",
            pool=service.pool_name,
            version=__version__,
            uptime_seconds=service.uptime(),
        )

    @api.get("/v1/pool", response_model=PoolSnapshot)
    async def pool() -> PoolSnapshot:
        """The latest snapshot of the pool, the queue and the counters (at most 100 ms old)."""
        return service.snapshot

    @api.get("/v1/pool/map", response_model=PoolMap)
    async def pool_map() -> PoolMap:
        """Every page's state, run-length encoded, with the snapshot of the same moment."""
        states, snapshot = await ctx.on_engine(service.page_states_and_snapshot)
        runs = await asyncio.to_thread(states.runs)
        return PoolMap(
            capacity_pages=states.capacity,
            segment_pages=states.segment_pages,
            runs=[(r.state.value, r.start, r.length) for r in runs],
            pool=snapshot,
        )

    @api.post("/v1/defrag", response_model=DefragResult, responses=ERRORS)
    async def defrag(request: Request, body: DefragRequest | None = None) -> DefragResult:
        """Defragment now, to completion or `max_pages`, between two engine steps."""
        max_pages = body.max_pages if body else None
        result = await ctx.on_engine(lambda: service.defrag_now(max_pages))
        ctx.audit_request(
            request,
            "defrag",
            "ok",
            max_pages=max_pages,
            pages_moved=result.pages_moved,
            fragmentation_before=result.fragmentation_before,
            fragmentation_after=result.fragmentation_after,
        )
        return result

    @api.post("/v1/pool/resize", response_model=ResizeResult, responses=ERRORS)
    async def resize(request: Request, body: ResizeRequest) -> ResizeResult:
        """Grow or shrink the pool in whole segments, or a host or disk tier in pages (`tier`);
        a refused resize changes nothing."""
        if body.tier == "device":
            per_page = service.snapshot.bytes_per_page
            pages = body.pages if body.pages is not None else -(-(body.bytes or 0) // per_page)
            run, refusals = (lambda: service.resize(pages)), (PoolError,)
        else:
            tier = next((t for t in service.snapshot.tiers if t.tier == body.tier), None)
            if tier is None:
                raise ApiError(
                    409,
                    f"this agent has no {body.tier} tier (start it with --host-tier-memory or "
                    "--disk-tier-path)",
                )
            pages = body.pages if body.pages is not None else (body.bytes or 0) // tier.page_bytes
            run, refusals = (lambda: service.resize_tier(body.tier, pages)), (ValueError,)
        try:
            result = await ctx.on_engine(run)
        except refusals as refused:
            ctx.audit_request(
                request, "resize", "refused", tier=body.tier, pages=pages, reason=str(refused)
            )
            raise ApiError(409, f"resize refused: {refused}") from None
        ctx.audit_request(
            request,
            "resize",
            "ok",
            tier=body.tier,
            old_pages=result.old_pages,
            new_pages=result.new_pages,
            pages_moved=result.pages_moved,
            pages_evicted=result.pages_evicted,
        )
        return result

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
        try:
            before, settings = await ctx.on_engine(lambda: service.change_settings(changes))
        except SettingsError as refused:
            ctx.audit_request(request, "config", "refused", reason=str(refused))
            raise ApiError(422, str(refused)) from None
        ctx.audit_request(request, "config", "ok", changed=_changed(before, settings))
        return settings

    @api.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        """The model this agent serves, OpenAI style: one card per served name (the first is the
        name answers report, the others alias it), with what it supports and its context."""
        served = service.served
        cards = [
            ModelCard(
                id=name,
                created=int(started_wall),
                root=served.name,
                capabilities=served.capabilities,
                max_model_len=served.context_length,
            )
            for name in served.names
        ]
        return ModelList(data=cards)

    @api.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus text exposition of the snapshot (docs/metrics.md)."""
        payload, content_type = render(registry)
        return Response(payload, media_type=content_type)

    return api


def _changed(before: RuntimeSettings, after: RuntimeSettings) -> dict[str, list[object]]:
    """`{"section.name": [old, new]}` for every setting that changed."""
    old, new = before.model_dump(), after.model_dump()
    return {
        f"{section}.{name}": [old[section][name], value]
        for section, values in new.items()
        for name, value in values.items()
        if old[section][name] != value
    }
