"""`kvctl pool show|map|resize|release`: the pool's numbers, its page map, changing its size, and
handing a pool pinned by a resize back to the agent.

An agent serving several models has one pool per model, all in one memory budget. `--pool NAME`
picks one; without it `show` shows every pool and the budget they share, while the commands that
need one pool pass the agent's refusal on (its message names the pools).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.text import Text

from kvctl.cli.options import (
    AgentOption,
    EveryPoolOption,
    ExitCode,
    JsonOption,
    PoolOption,
    Target,
    TimeoutOption,
    TokenOption,
    YesOption,
    fail,
    resolve,
)
from kvctl.cli.output import Outcome, confirm, console, finish, on_agent, on_each, to_jsonable
from kvctl.view import poolmap, render
from kvctl.view.untrusted import clean

if TYPE_CHECKING:
    from kvctl.api import PoolList, PoolRelease, PoolSnapshot, ResizeResult, TierReading
    from kvctl.client import AgentClient
    from kvctl.sizing import ResizePlan, ResizeSpec

pool_app = typer.Typer(
    help="Show the pool, its page map, resize it, or release a pinned pool.",
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
    pool: EveryPoolOption = None,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Show the pool: the four headline numbers, geometry, requests, defrag, GPU memory, and
    what it holds (requests of the model's context; the size for --requests of them).

    An agent serving several models: the budget their pools share (a bar split by pool), then
    every pool with its share: floor and ceiling, pinned, pressure, rebalances.

    With --json: the pool snapshot alone (a list of them for several pools).
    """
    target = resolve(ctx, agent, token, json_out, timeout)
    outcomes = on_each(target, lambda client: _read(client, pool, contexts=not target.json))
    finish(target, outcomes, lambda shown: _render_pools(shown, requests), as_json=_pools_json)


@dataclass(frozen=True)
class Shown:
    """What `pool show` prints of one agent: its pools (or the one named) and their contexts."""

    listing: PoolList
    contexts: dict[str, int | None]
    named: bool = False
    """`--pool` named the one pool in `listing`, so the budget it shares is not all shown."""

    @property
    def budget(self) -> bool:
        """Whether to show the budget: every pool is shown, and they share one."""
        pools = self.listing.pools
        return not self.named and (len(pools) > 1 or pools[0].share is not None)


def _read(client: AgentClient, pool: str | None, contexts: bool) -> Shown:
    from kvctl.api import PoolList

    listing = client.pools() if pool is None else PoolList(pools=[client.pool(pool)])
    return Shown(listing, _contexts(client, listing.pools) if contexts else {}, pool is not None)


def _contexts(client: AgentClient, pools: list[PoolSnapshot]) -> dict[str, int | None]:
    """Each pool's model context from /v1/models; None from an agent that does not say."""
    from kvctl.client import AgentError

    try:
        cards = client.models().data
    except AgentError:
        return {}
    by_name = {card.id: card.max_model_len for card in cards}
    only = cards[0].max_model_len if len(cards) == 1 else None
    return {p.pool: by_name.get(p.pool, only) for p in pools}


def _render_pools(shown: Shown, requests: int) -> RenderableType:
    """One pool as before several models; every pool of a budget after the budget, each under
    a rule with its name."""
    listing = shown.listing
    pools = listing.pools
    if not shown.budget:
        return _render_pool(pools[0], shown.contexts.get(pools[0].pool), requests)
    parts: list[RenderableType] = [
        render.budget_table(pools, listing.budget_bytes, listing.assigned_bytes)
    ]
    for pool in pools:
        if len(pools) > 1:
            parts.append(Rule(Text(f"pool {clean(pool.pool)}"), align="left", style="dim"))
        parts.append(_render_pool(pool, shown.contexts.get(pool.pool), requests))
    return Group(*parts)


def _render_pool(pool: PoolSnapshot, context: int | None, requests: int) -> RenderableType:
    return Group(
        render.headline_table(pool),
        render.pool_table(pool),
        render.sizing_table(pool, context, requests),
    )


def _pools_json(shown: Shown) -> object:
    pools = shown.listing.pools
    return to_jsonable(pools[0] if len(pools) == 1 else pools)


@pool_app.command("map")
def show_map(
    ctx: typer.Context,
    width: Annotated[
        int | None,
        typer.Option("--width", min=16, help="Columns per row \\[default: the terminal's]."),
    ] = None,
    rows: Annotated[int, typer.Option("--rows", min=1, max=200, help="Rows of cells.")] = 4,
    pool: PoolOption = None,
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
    outcomes = on_each(target, lambda client: client.pool_map(pool))
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
    pool: PoolOption = None,
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

    A pool that shares a budget with other models' pools is pinned at its new size: the agent
    moves no memory in or out of it until `kvctl pool release --pool NAME`.
    """
    target = resolve(ctx, agent, token, json_out, timeout)
    spec: ResizeSpec = {"pages": pages, "size": size, "grow": grow, "shrink": shrink}
    if sum(value is not None for value in spec.values()) != 1:
        fail("pool resize: give exactly one of --pages, --size, --grow or --shrink", ExitCode.USAGE)
    plans = _plans(target, spec, tier, pool)
    if not json_out:
        for o in plans:
            if o.result is not None and not o.result.changes:
                console().print(o.result.line, markup=False, soft_wrap=True)
    ready = [o for o in plans if o.result is not None and o.result.changes]
    if ready:
        lines = "\n".join("  " + o.result.line for o in ready if o.result is not None)
        what = "pool(s)" if tier is Tier.DEVICE else f"{tier.value} tier(s)"
        if yes and not json_out:  # no prompt to read the rounding from: say it before the result
            for o in ready:
                if o.result is not None and o.result.plan.rounded:
                    console().print(o.result.line, markup=False, soft_wrap=True)
        confirm(f"Resize {len(ready)} {what}:\n{lines}\nProceed?", yes)
    outcomes = [_apply(target, o, pool) for o in plans]
    finish(
        target,
        outcomes,
        lambda done: render.resize_result(done.result, done.pool),
        as_json=lambda done: to_jsonable(done.result),
    )


@dataclass(frozen=True)
class Planned:
    """A resize to ask for, and the line that shows it before asking."""

    plan: ResizePlan
    line: str
    pool: str | None = None
    """The pool `--pool` named (None: the agent's only pool)."""

    @property
    def changes(self) -> bool:
        return self.plan.new_pages != self.plan.old_pages


def _plans(
    target: Target, spec: ResizeSpec, tier: Tier, name: str | None
) -> list[Outcome[Planned]]:
    """Each agent's plan from its current size; a bad spec stops here as a usage error, and an
    agent without the tier (or serving several models when no --pool names one) as an error,
    before anything is changed."""
    from kvctl.sizing import plan_resize

    def plan(client: AgentClient) -> Planned:
        pool = client.pool(name)
        where = client.url if name is None else f"{client.url} pool {name}"
        pins = tier is Tier.DEVICE and pool.share is not None and not pool.share.pinned
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
            line = render.tier_resize_plan(where, pool, reading, planned)
            return Planned(planned, line, name)
        try:
            planned = plan_resize(pool, **spec)
        except ValueError as error:
            fail(str(error), ExitCode.USAGE)
        line = render.resize_plan(where, planned)
        if pins and planned.new_pages != planned.old_pages:
            line += "; pins the pool (the agent stops moving memory in or out of it until released)"
        return Planned(planned, line, name)

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


@dataclass(frozen=True)
class Resized:
    """What a resize did, and the pool to name when showing it."""

    result: ResizeResult
    pool: str | None


def _apply(target: Target, planned: Outcome[Planned], name: str | None) -> Outcome[Resized]:
    """Carry out one agent's plan on the pool `name` (None: its only pool)."""
    if planned.result is None:
        return Outcome(planned.agent, error=planned.error)
    request = planned.result.plan.request
    return on_agent(
        target, planned.agent, lambda client: Resized(client.resize(request, name), name)
    )


@pool_app.command("release")
def release(
    ctx: typer.Context,
    pool: PoolOption = None,
    yes: YesOption = False,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Hand a pool pinned by `pool resize` back to the agent, which may again move memory in
    and out of it as its models need.

    Only a pool that shares a memory budget with other models' pools can be pinned.

    With several agents it asks first (skip with --yes).
    """
    target = resolve(ctx, agent, token, json_out, timeout)
    if target.fleet:
        which = "the pool" if pool is None else f"pool {pool}"
        confirm(f"Release {which} of {len(target.agents)} agents?", yes)

    def hand_back(client: AgentClient) -> PoolRelease:
        # Without --pool: the only pool's name, or the agent's refusal naming its pools.
        return client.release(pool if pool is not None else client.pool().pool)

    finish(target, on_each(target, hand_back), render.release_result)
