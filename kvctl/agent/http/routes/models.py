"""`GET /v1/models`: the models this agent serves, OpenAI style."""

from __future__ import annotations

from fastapi import APIRouter

from kvctl.agent.http.context import Context
from kvctl.api import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def models(ctx: Context) -> ModelList:
    """The models this agent serves, OpenAI style: one card per served name (a model's
    first name is the one answers report, the others alias it, `root`), with what it
    supports and its context."""
    cards = [
        ModelCard(
            id=name,
            created=int(ctx.started_wall),
            root=served.name,
            capabilities=served.capabilities,
            max_model_len=served.context_length,
        )
        for served in (pool.served for pool in ctx.service.pools.values())
        for name in served.names
    ]
    return ModelList(data=cards)
