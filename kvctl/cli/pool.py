"""`kvctl pool show|map|resize`: the pool's numbers, its page map, and changing its size."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from enum import StrEnum
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
    from kvctl.api import PoolSnapshot, ResizeResult, TierReading
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


class Tier(StrEnum):
    """What `pool resize --tier` changes: the device pool, or a tier below it."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@pool_app.command("resize")
def resize(
    ctx: typer.Context,
    pages: Annotated[
        int | None, typer.Option("--pages", min=0, help="New size in pages.", show_default=False)
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
    tier: Annotated[
        Tier,
        typer.Option(
            "--tier",
            help="The device pool, or the host or disk tier below it (0 turns a tier off).",
        ),
    ] = Tier.DEVICE,
    yes: YesOption = False,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Grow or shrink the pool, in whole segments, after a confirmation (skip with --yes).

    A shrink moves live pages out of the tail segments first.

    A shrink below the pages in use is refused and changes nothing.

    With --tier host or --tier disk: the tier below the device, in whole pages of that tier;
    pages that no longer fit go down to the next tier (or are dropped from the last one).
    """
    target = resolve(ctx, agent, token, json_out, timeout)
    spec = {"pages": pages, "size": size, "grow": grow, "shrink": shrink}
    if sum(value is not None for value in spec.values()) != 1:
        fail("pool resize: give exactly one of --pages, --size, --grow or --shrink", ExitCode.USAGE)
    plans = _plans(target, spec, tier)
    if not json_out:
        for o in plans:
            if o.result is not None and not o.result.changes:
                console().print(o.result.line, markup=False, soft_wrap=True)
    ready = [o for o in plans if o.result is not None and o.result.changes]
    if ready:
        lines = "\n".join("  " + o.result.line for o in ready if o.result is not None)
        what = "pool(s)" if tier is Tier.DEVICE else f"{tier.value} tier(s)"
        confirm(f"Resize {len(ready)} {what}:\n{lines}\nProceed?", yes)
    outcomes = [_apply(target, o) for o in plans]
    finish(target, outcomes, render.resize_result)


@dataclass(frozen=True)
class Planned:
    """A resize to ask for, and the line that shows it before asking."""

    plan: ResizePlan
    line: str

    @property
    def changes(self) -> bool:
        return self.plan.new_pages != self.plan.old_pages


def _plans(target: Target, spec: dict[str, str | int | None], tier: Tier) -> list[Outcome[Planned]]:
    """Each agent's plan from its current size; a bad spec stops here as a usage error, and an
    agent without the tier as an error, before anything is changed."""
    from kvctl.sizing import plan_resize

    def plan(client: AgentClient) -> Planned:
        pool = client.pool()
        if tier is not Tier.DEVICE:
            reading = next((t for t in pool.tiers if t.tier == tier.value), None)
            if reading is None:
                fail(
                    f"agent {client.url} has no {tier.value} tier; start it with "
                    f"--{'host-tier-memory' if tier is Tier.HOST else 'disk-tier-path'} "
                    "to have one",
                    ExitCode.ERROR,
                )
            try:
                planned = plan_tier_resize(reading, **spec)
            except ValueError as error:
                fail(str(error), ExitCode.USAGE)
            return Planned(planned, render.tier_resize_plan(client.url, pool, reading, planned))
        try:
            planned = plan_resize(pool, **spec)
        except ValueError as error:
            fail(str(error), ExitCode.USAGE)
        return Planned(planned, render.resize_plan(client.url, planned))

    return on_each(target, plan)


def plan_tier_resize(
    tier: TierReading,
    *,
    pages: int | None = None,
    size: str | None = None,
    grow: str | None = None,
    shrink: str | None = None,
) -> ResizePlan:
    """The request for a host or disk tier, in whole pages of that tier (a size is rounded down,
    as the agent rounds it, so the confirmation shows what will happen); ValueError says what is
    off. 0 pages turns the tier off."""
    from kvctl.api import ResizeRequest
    from kvctl.sizing import ResizePlan, amount_in_pages
    from kvctl.units import format_bytes, parse_size

    page = tier.page_bytes
    if pages is not None:
        target = pages
    elif size is not None:
        count = parse_size(size)
        target = count // page
        if count and not target:
            raise ValueError(
                f"--size {size} is less than one page of the {tier.tier} tier "
                f"({format_bytes(page)}); give a larger size, or 0 to turn the tier off"
            )
    elif grow is not None:
        target = tier.capacity_pages + amount_in_pages(grow, page)
    else:
        assert shrink is not None
        target = tier.capacity_pages - amount_in_pages(shrink, page)
        if target < 0:
            raise ValueError(
                f"cannot shrink by {shrink}: the {tier.tier} tier has only "
                f"{tier.capacity_pages:,} pages; give a smaller amount, or --pages 0 to turn it off"
            )
    return ResizePlan(
        request=ResizeRequest(tier=tier.tier, pages=target),
        old_pages=tier.capacity_pages,
        new_pages=target,
        bytes_per_page=page,
        asked_pages=target,
    )


def _apply(target: Target, planned: Outcome[Planned]) -> Outcome[ResizeResult]:
    if planned.result is None:
        return Outcome(planned.agent, error=planned.error)
    request = planned.result.plan.request
    return on_agent(target, planned.agent, lambda client: client.resize(request))
