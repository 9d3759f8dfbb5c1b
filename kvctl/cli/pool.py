"""`kvctl pool show|map|resize`: the pool's numbers, its page map, and changing its size."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Group, RenderableType

from kvctl.cli.options import (
    AgentOption,
    ExitCode,
    JsonOption,
    Target,
    TimeoutOption,
    TokenOption,
    YesOption,
    fail,
    resolve,
)
from kvctl.cli.output import Outcome, confirm, console, finish, on_agent, on_each
from kvctl.view import poolmap, render

if TYPE_CHECKING:
    from kvctl.api import PoolSnapshot, ResizeResult
    from kvctl.client import AgentClient
    from kvctl.sizing import ResizePlan

pool_app = typer.Typer(
    help="Show the pool, its page map, or resize it.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


@pool_app.command("show")
def show(
    ctx: typer.Context,
    requests: Annotated[
        int,
        typer.Option(
            "--requests", "-n", min=1, max=100_000, help="Full contexts at once to size for."
        ),
    ] = 8,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Show the pool: the four headline numbers, geometry, requests, defrag, GPU memory, and
    what it holds (requests of the model's context; the size for --requests of them).

    With --json: the pool snapshot alone.
    """
    target = resolve(ctx, agent, token, json_out, timeout)
    if target.json:
        finish(target, on_each(target, lambda client: client.pool()), render.pool_table)
        return
    outcomes = on_each(target, lambda client: (client.pool(), _context(client)))
    finish(target, outcomes, lambda reading: _render_pool(*reading, requests))


def _context(client: AgentClient) -> int | None:
    """The served model's context from /v1/models; None from an agent that does not say."""
    from kvctl.client import AgentError

    try:
        cards = client.models().data
    except AgentError:
        return None
    return cards[0].max_model_len if cards else None


def _render_pool(pool: PoolSnapshot, context: int | None, requests: int) -> RenderableType:
    return Group(
        render.headline_table(pool),
        render.pool_table(pool),
        render.sizing_table(pool, context, requests),
    )


@pool_app.command("map")
def show_map(
    ctx: typer.Context,
    width: Annotated[
        int | None,
        typer.Option("--width", min=16, help="Columns per row \\[default: the terminal's]."),
    ] = None,
    rows: Annotated[int, typer.Option("--rows", min=1, max=200, help="Rows of cells.")] = 4,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Show which pages are used, cached or free, as a heat strip with segment starts.

    With --json: the map as runs of \\[state, first_page, length].
    """
    target = resolve(ctx, agent, token, json_out, timeout)
    cells = width or max(16, shutil.get_terminal_size((100, 24)).columns)
    outcomes = on_each(target, lambda client: client.pool_map())
    finish(target, outcomes, lambda page_map: poolmap.grid(page_map, cells, rows))


@pool_app.command("resize")
def resize(
    ctx: typer.Context,
    pages: Annotated[
        int | None, typer.Option("--pages", min=1, help="New size in pages.", show_default=False)
    ] = None,
    size: Annotated[
        str | None, typer.Option("--size", metavar="SIZE", help="New size, e.g. 8GiB.")
    ] = None,
    grow: Annotated[
        str | None,
        typer.Option("--grow", metavar="X", help="Grow by X pages, or by a size such as 1GiB."),
    ] = None,
    shrink: Annotated[
        str | None,
        typer.Option("--shrink", metavar="X", help="Shrink by X pages, or by a size."),
    ] = None,
    yes: YesOption = False,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Grow or shrink the pool, in whole segments, after a confirmation (skip with --yes).

    A shrink moves live pages out of the tail segments first.

    A shrink below the pages in use is refused and changes nothing.
    """
    target = resolve(ctx, agent, token, json_out, timeout)
    spec = {"pages": pages, "size": size, "grow": grow, "shrink": shrink}
    if sum(value is not None for value in spec.values()) != 1:
        fail("pool resize: give exactly one of --pages, --size, --grow or --shrink", ExitCode.USAGE)
    plans = _plans(target, spec)
    if not json_out:
        for o in plans:
            if o.result is not None and o.result.new_pages == o.result.old_pages:
                console().print(render.resize_plan(o.agent, o.result), markup=False, soft_wrap=True)
    ready = [o for o in plans if o.result is not None and o.result.new_pages != o.result.old_pages]
    if ready:
        lines = "\n".join("  " + render.resize_plan(o.agent, o.result) for o in ready)
        confirm(f"Resize {len(ready)} pool(s):\n{lines}\nProceed?", yes)
    outcomes = [_apply(target, o) for o in plans]
    finish(target, outcomes, render.resize_result)


def _plans(target: Target, spec: dict[str, str | int | None]) -> list[Outcome[ResizePlan]]:
    """Each agent's plan from its current capacity; a bad spec stops here as a usage error."""
    from kvctl.sizing import plan_resize

    def plan(client: AgentClient) -> ResizePlan:
        pool = client.pool()
        try:
            return plan_resize(pool, **spec)
        except ValueError as error:
            fail(str(error), ExitCode.USAGE)

    return on_each(target, plan)


def _apply(target: Target, planned: Outcome[ResizePlan]) -> Outcome[ResizeResult]:
    if planned.result is None:
        return Outcome(planned.agent, error=planned.error)
    request = planned.result.request
    return on_agent(target, planned.agent, lambda client: client.resize(request))
