"""`/v1/config`: the runtime settings in force, and changes to them (docs/settings.md)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request

from kvctl.agent.http.context import ERRORS, ApiError, Context
from kvctl.api import RuntimeSettings, RuntimeSettingsPatch, lone_surrogate
from kvctl.settings import SettingsError

router = APIRouter()


@router.get("/v1/config", response_model=RuntimeSettings)
async def get_config(ctx: Context) -> RuntimeSettings:
    """The runtime settings in force (docs/settings.md)."""
    return ctx.service.settings


@router.patch(
    "/v1/config",
    response_model=RuntimeSettings,
    responses=ERRORS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": RuntimeSettingsPatch.model_json_schema()}},
        }
    },
)
async def patch_config(request: Request, ctx: Context) -> RuntimeSettings:
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
    service = ctx.service
    try:
        before, settings = await ctx.on_engine(lambda: service.change_settings(changes))
    except SettingsError as refused:
        ctx.audit_request(request, "config", "refused", reason=str(refused))
        raise ApiError(422, str(refused)) from None
    ctx.audit_request(request, "config", "ok", changed=changed(before, settings))
    return settings


def changed(before: RuntimeSettings, after: RuntimeSettings) -> dict[str, list[object]]:
    """`{"section.name": [old, new]}` for every setting that changed (the audit line's)."""
    old, new = before.model_dump(), after.model_dump()
    return {
        f"{section}.{name}": [old[section][name], value]
        for section, values in new.items()
        for name, value in values.items()
        if old[section][name] != value
    }
