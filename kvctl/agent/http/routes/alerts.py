"""`/v1/alerts`: the agent's own alerts, and a test alert through its Alertmanager route."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from kvctl.agent.http.context import ERRORS, ApiError, Context
from kvctl.alerts import AlertmanagerError
from kvctl.api import AlertList

router = APIRouter()


@router.get("/v1/alerts", response_model=AlertList)
async def alerts(ctx: Context) -> AlertList:
    """The agent's own pending and firing alerts, with cause and remediation."""
    return AlertList(alerts=ctx.service.alerts)


@router.post("/v1/alerts/test", responses=ERRORS)
async def alert_test(request: Request, ctx: Context) -> dict:
    """Send a test alert through this agent's own Alertmanager route and credentials."""
    alerting = ctx.service.alerting
    try:
        if alerting is None:
            raise AlertmanagerError("this agent evaluates no alerts")
        alert = await asyncio.to_thread(alerting.send_test)
    except AlertmanagerError as error:
        ctx.audit_request(request, "alert_test", "refused", reason=str(error))
        raise ApiError(409, str(error)) from None
    ctx.audit_request(request, "alert_test", "ok", labels=alert.get("labels", {}))
    return {"sent": True, "alert": alert}
