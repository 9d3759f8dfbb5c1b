"""`kvctl simulate`: replay a synthetic workload against contiguous and paged KV allocation,
multi-turn chat against a device pool without and with a host tier (`tiered-prefix`), or three
models' pools sharing one budget, split statically and rebalanced (`budget`).

The simulator is imported inside the command, never at module level, so `kvctl --help` stays
fast and loads none of the pool code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.view.fmt import percent

if TYPE_CHECKING:
    from rich.table import Table


class Scenario(StrEnum):
    """The three allocation scenarios (`kvctl.simulate.workloads`), the tiered one and the shared
    budget."""

    HIGH_CONCURRENCY = "high-concurrency"
    RANDOM_LENGTHS = "random-lengths"
    MULTI_MODEL = "multi-model"
    TIERED_PREFIX = "tiered-prefix"
    BUDGET = "budget"


class Mix(StrEnum):
    """The load mixes of the budget scenario."""

    ONE_HOT = "one-hot"
    MOVING = "moving"
    ALL_BUSY = "all-busy"


def _ratio(value: float) -> str:
    return f"{value:.2f}"


def _count(value: float) -> str:
    return f"{value:,.0f}"


def _gib(value: float) -> str:
    return f"{value / 2**30:,.1f} GiB"


def _field(key: str, fmt: Callable[[float], str]) -> Callable[[dict[str, Any]], str]:
    return lambda side: fmt(side[key])


ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("requests", _field("requests", _count)),
    ("completed", _field("completed", _count)),
    ("OOM failure rate (admitted, then no memory)", _field("failure_rate", percent)),
    ("preemptions (recomputed later)", _field("preemptions", _count)),
    ("utilisation: budget holding real tokens", _field("utilization_mean", percent)),
    ("reserved: budget held by ranges or pages", _field("reserved_mean", percent)),
    ("fragmentation of free space, mean", _field("fragmentation_mean", _ratio)),
    ("fragmentation of free space, peak", _field("fragmentation_peak", _ratio)),
    ("free extents, mean", _field("free_extents_mean", _count)),
    ("allocation attempts", _field("alloc_attempts", _count)),
    ("allocation failures", _field("alloc_failures", _count)),
    ("defragmentation runs", _field("defrag_runs", _count)),
    ("pages moved (defrag + shrink)", _field("defrag_pages_moved", _count)),
    ("pool grows / shrinks", lambda s: f"{s['pool_grows']:,} / {s['pool_shrinks']:,}"),
    ("steps (measured)", lambda s: f"{s['steps']:,} ({s['measured_steps']:,})"),
    ("KV budget", _field("budget_bytes", _gib)),
)
"""Table rows: label and how to read it from one side's result. Means are over loaded steps."""


def render_table(result: dict[str, Any]) -> Table:
    """The comparison as a rich table: one row per metric, one column per allocator (or, for
    tiered-prefix, per side: without and with a host tier)."""
    from rich.table import Table

    sides = result["results"]
    scenario = result["scenario"]
    if "mix" in result:
        scenario += f" ({result['mix']})"
    table = Table(title=f"kvctl simulate: {scenario}, seed {result['seed']}")
    table.add_column("metric")
    for name in sides:
        table.add_column(name, justify="right")
    rows = {Scenario.TIERED_PREFIX: TIERED_ROWS, Scenario.BUDGET: BUDGET_ROWS}.get(
        result["scenario"], ROWS
    )
    for label, read in rows:
        table.add_row(label, *(read(side) for side in sides.values()))
    return table


def _pages(key: str) -> Callable[[dict[str, Any]], str]:
    def read(side: dict[str, Any]) -> str:
        pages = side[key]
        return f"{pages:,} ({percent(pages / side['working_set_pages'])})" if pages else "none"

    return read


TIERED_ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    (
        "conversations × turns",
        lambda s: f"{s['conversations']} × {s['turns'] // s['conversations']}",
    ),
    ("device pool, pages (of the working set)", _pages("device_pages")),
    ("host tier, pages (of the working set)", _pages("host_pages")),
    ("prefix hit rate (reused ÷ looked-up)", _field("hit_rate", percent)),
    ("  from the device", lambda s: percent(s["hit_rate_by_tier"]["device"])),
    ("  from the host tier", lambda s: percent(s["hit_rate_by_tier"]["host"])),
    ("  with unbounded memory", _field("ideal_hit_rate", percent)),
    ("prompt tokens computed", _field("computed_prompt_tokens", _count)),
    (
        "host pages stored / loaded",
        lambda s: f"{s['host_stored_pages']:,} / {s['host_loaded_pages']:,}",
    ),
    ("device prefix evictions (pages)", _field("device_evicted_pages", _count)),
    ("preemptions (recomputed later)", _field("preemptions", _count)),
    ("steps", _field("steps", _count)),
)
"""Rows of the tiered scenario: one column without a host tier, one with it."""


def _per_model(key: str, fmt: Callable[[float], str]) -> Callable[[dict[str, Any]], str]:
    """One figure of every model, in the order of the models, separated by slashes."""
    return lambda side: " / ".join(fmt(model[key]) for model in side["models"].values())


BUDGET_ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("requests", _field("requests", _count)),
    ("finished by the last arrival", _field("finished_in_load", _count)),
    (
        "allocation failure rate (failed ÷ attempted)",
        lambda s: percent(s["alloc_failure_rate"], 2),
    ),
    (
        "allocation attempts / failures",
        lambda s: f"{s['alloc_attempts']:,} / {s['alloc_failures']:,}",
    ),
    ("preemptions (recomputed later)", _field("preemptions", _count)),
    ("KV the preempted requests dropped", _field("recomputed_bytes", _gib)),
    ("utilisation: budget holding real tokens", _field("utilization_mean", percent)),
    (
        "queue time p99 / mean, steps",
        lambda s: f"{s['queue_p99_steps']:,} / {s['queue_mean_steps']:,.1f}",
    ),
    (
        "per model (70B / 7B / 2B): share of the budget",
        _per_model("share_mean", lambda v: percent(v, 0)),
    ),
    ("  preemptions", _per_model("preemptions", _count)),
    ("  queue time p99, steps", _per_model("queue_p99_steps", _count)),
    ("rebalances (moves)", _field("rebalances", _count)),
    ("memory moved", _field("moved_bytes", _gib)),
    ("pool grows / shrinks", lambda s: f"{s['pool_grows']:,} / {s['pool_shrinks']:,}"),
    ("pages evacuated by shrinks", _field("pages_evacuated", _count)),
    ("steps (measured)", lambda s: f"{s['steps']:,} ({s['measured_steps']:,})"),
    ("KV budget", _field("budget_bytes", _gib)),
)
"""Rows of the budget scenario: one column for the static split, one with rebalancing."""


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on stderr while requests settle; nothing when disabled or not a terminal."""
    from rich.console import Console

    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield None
        return
    from rich.progress import Progress

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("simulating", total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


def simulate(
    scenario: Annotated[
        Scenario,
        typer.Option(
            help="Workload to replay: three allocation scenarios (a burst, random lengths, "
            "three models on one device), tiered-prefix "
            "(multi-turn chat on a pool holding a quarter of it, without and with a host tier), "
            "or budget (three models sharing one KV budget, static split against rebalancing)."
        ),
    ] = Scenario.RANDOM_LENGTHS,
    seed: Annotated[int, typer.Option(help="Seed of the workload; a seed names one run.")] = 0,
    requests: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Number of requests (default: the scenario's; tiered-prefix: turns, 6 a "
            "conversation; budget: about this many over the same 600 steps).",
        ),
    ] = None,
    budget_fraction: Annotated[
        float | None,
        typer.Option(
            min=0.01,
            max=1.0,
            help="KV budget as a share of peak demand (default: the scenario's; tiered-prefix: "
            "the device pool as a share of the working set, 0.25; budget: a share of the "
            "stream's peak of live tokens, 0.8).",
        ),
    ] = None,
    mix: Annotated[
        Mix | None,
        typer.Option(
            help="budget only: the load mix (one model hot all along, the hot model moving "
            "every third of the run, all three busy). Default: moving.",
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Replay a workload against contiguous and paged KV allocation under one memory budget.

    tiered-prefix: multi-turn chat on the agent's scheduler, without and with a host tier.
    budget: three models' pools sharing one budget, a static split against the rebalancer.
    """
    from kvctl.simulate.scenarios import run_scenario

    overrides: dict[str, Any] = {"requests": requests, "budget_fraction": budget_fraction}
    if mix is not None:
        if scenario != Scenario.BUDGET:
            typer.echo("kvctl: error: --mix applies to --scenario budget only", err=True)
            raise typer.Exit(2)
        overrides["mix"] = mix.value
    with _progress_bar(not json_output) as progress:
        try:
            result = run_scenario(scenario.value, seed, progress, **overrides)
        except ValueError as error:
            typer.echo(f"kvctl: error: {error}", err=True)
            raise typer.Exit(2) from None
    if json_output:
        typer.echo(json.dumps(result))
    else:
        from rich.console import Console

        Console().print(render_table(result))
