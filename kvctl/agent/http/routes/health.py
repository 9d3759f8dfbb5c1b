"""`GET /healthz`: liveness, served from memory without a token, however busy the engine is."""

from __future__ import annotations

from fastapi import APIRouter

from kvctl import __version__
from kvctl.agent.http.context import Context
from kvctl.api import Health

router = APIRouter()


@router.get("/healthz", response_model=Health)
async def healthz(ctx: Context) -> Health:
    """Liveness: answers while the process serves HTTP, without a token."""
    service = ctx.service
    names = list(service.pools)
    return Health(
        status="ok",
        pool=names[0],
        version=__version__,
        uptime_seconds=service.uptime(),
        pools=names,
    )
