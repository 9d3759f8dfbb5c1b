"""`GET /metrics`: the Prometheus exposition of every pool's latest snapshot (docs/metrics.md),
built at scrape time, never waiting on the engine."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from kvctl.agent.http.context import Context
from kvctl.agent.observe.metrics import render

router = APIRouter()


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(ctx: Context) -> Response:
    """Prometheus text exposition of the snapshot (docs/metrics.md)."""
    payload, content_type = render(ctx.registry)
    return Response(payload, media_type=content_type)
