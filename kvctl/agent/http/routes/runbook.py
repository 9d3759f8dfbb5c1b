"""`GET /runbook`: the alert runbook (docs/alerts.md), served by the agent itself.

Every alert's `runbook_url` points here by default (`<advertise-url>/runbook#<alertname>`), so
the link in a notification opens the runbook of the very version that raised the alert, with
nothing else to host. It is the project's static documentation and says nothing about the node,
which is why it needs no token.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse


@cache
def runbook_text() -> str:
    return resources.files("kvctl.alerts").joinpath("runbook.md").read_text(encoding="utf-8")


router = APIRouter()


@router.get("/runbook", response_class=PlainTextResponse)
async def runbook() -> PlainTextResponse:
    """The alert runbook as Markdown (docs/alerts.md), without a token."""
    return PlainTextResponse(runbook_text(), media_type="text/markdown; charset=utf-8")
