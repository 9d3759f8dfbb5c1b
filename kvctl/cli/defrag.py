"""`kvctl defrag`: compact the pool now (`--now`), or show what the defragmenter has done.

On an agent serving several models, `--now` needs `--pool NAME` (the agent's refusal names the
pools); without `--now` it shows every pool, or the one `--pool` names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.text import Text

from kvctl.cli.options import (
    AgentOption,
    JsonOption,
    PoolOption,
    TimeoutOption,
    TokenOption,
    YesOption,
    fail,
    resolve,
)
from kvctl.cli.output import ExitCode, confirm, finish, on_each, to_jsonable
from kvctl.view import render
from kvctl.view.untrusted import clean

if TYPE_CHECKING:
    from kvctl.api import PoolSnapshot
    from kvctl.client import AgentClient

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
"""The PoolSnapshot fields `kvctl defrag --json` prints without `--now` (with `pool` added for
each pool of an agent that serves several models)."""


def defrag(
    ctx: typer.Context,
    now: Annotated[bool, typer.Option("--now", help="Defragment now.")] = False,
    max_pages: Annotated[
        int | None,
        typer.Option("--max-pages", min=1, help="Move at most this many pages (with --now)."),
    ] = None,
    pool: PoolOption = None,
    yes: YesOption = False,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Defragment the pool with --now; without it, show fragmentation and past runs.

    Live pages move through the page tables, so running requests give the same tokens.

    An agent serving several models: --now needs --pool NAME; without --now every pool is
    shown unless --pool names one.

    With several agents it asks first (skip with --yes).
    """
    if max_pages is not None and not now:
        fail("--max-pages limits a defragmentation: add --now to run one", ExitCode.USAGE)
    target = resolve(ctx, agent, token, json_out, timeout)
    if not now:
        outcomes = on_each(target, lambda client: _pools(client, pool))
        finish(target, outcomes, _render_states, as_json=_states_json)
        return
    if target.fleet:
        which = "pools" if pool is None else f"pool {pool}"
        confirm(f"Defragment the {which} of {len(target.agents)} agents now?", yes)
    results = on_each(target, lambda client: client.defrag(max_pages, pool))
    finish(target, results, lambda result: render.defrag_result(result, pool))


def _pools(client: AgentClient, pool: str | None) -> list[PoolSnapshot]:
    return client.pools().pools if pool is None else [client.pool(pool)]


def _render_states(pools: list[PoolSnapshot]) -> RenderableType:
    if len(pools) == 1:
        return render.defrag_state(pools[0])
    parts: list[RenderableType] = []
    for pool in pools:
        parts += [
            Rule(Text(f"pool {clean(pool.pool)}"), align="left", style="dim"),
            render.defrag_state(pool, named=True),
        ]
    return Group(*parts)


def _states_json(pools: list[PoolSnapshot]) -> Any:
    if len(pools) == 1:
        return _state_json(pools[0])
    return [{"pool": pool.pool, **_state_json(pool)} for pool in pools]


def _state_json(pool: PoolSnapshot) -> dict[str, Any]:
    return {key: to_jsonable(getattr(pool, key)) for key in STATE_KEYS}
