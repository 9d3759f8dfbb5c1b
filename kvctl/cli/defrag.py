"""`kvctl defrag`: compact the pool now (`--now`), or show what the defragmenter has done."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.cli.options import (
    AgentOption,
    JsonOption,
    TimeoutOption,
    TokenOption,
    YesOption,
    fail,
    resolve,
)
from kvctl.cli.output import ExitCode, confirm, finish, on_each, to_jsonable
from kvctl.view import render

if TYPE_CHECKING:
    from kvctl.api import PoolSnapshot

STATE_KEYS = (
    "fragmentation_ratio",
    "free_extents",
    "largest_free_run",
    "auto_defrag_enabled",
    "defrag_active",
    "defrag_runs_total",
    "defrag_pages_moved_total",
    "last_defrag",
    "last_defrag_age_seconds",
)
"""The PoolSnapshot fields `kvctl defrag --json` prints without `--now`."""


def defrag(
    ctx: typer.Context,
    now: Annotated[bool, typer.Option("--now", help="Defragment now.")] = False,
    max_pages: Annotated[
        int | None,
        typer.Option("--max-pages", min=1, help="Move at most this many pages (with --now)."),
    ] = None,
    yes: YesOption = False,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Defragment the pool with --now; without it, show fragmentation and past runs.

    Live pages move through the page tables, so running requests give the same tokens.

    With several agents it asks first (skip with --yes).
    """
    if max_pages is not None and not now:
        fail("--max-pages limits a defragmentation: add --now to run one", ExitCode.USAGE)
    target = resolve(ctx, agent, token, json_out, timeout)
    if not now:
        outcomes = on_each(target, lambda client: client.pool())
        finish(target, outcomes, render.defrag_state, as_json=_state_json)
        return
    if target.fleet:
        confirm(f"Defragment the pools of {len(target.agents)} agents now?", yes)
    outcomes = on_each(target, lambda client: client.defrag(max_pages))
    finish(target, outcomes, render.defrag_result)


def _state_json(pool: PoolSnapshot) -> dict[str, Any]:
    return {key: to_jsonable(getattr(pool, key)) for key in STATE_KEYS}
