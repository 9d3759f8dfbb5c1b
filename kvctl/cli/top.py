"""`kvctl top`: the live dashboard, or status snapshots where there is no terminal.

Like nvitop's `-1`, it prints one snapshot and exits when stdout is not a terminal or with
`--once`; `--headless` prints the fleet table every `--every` seconds for `--duration` seconds,
for a demo or a log on a machine without a terminal. Textual is imported only when the
dashboard really opens.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.rule import Rule

from kvctl.cli.options import (
    AgentOption,
    ExitCode,
    JsonOption,
    PrometheusOption,
    SelectorOption,
    Target,
    TimeoutOption,
    TokenOption,
    fail,
    resolve,
)
from kvctl.cli.output import console, print_json
from kvctl.cli.status import print_status, read_once, status_code
from kvctl.view import render

if TYPE_CHECKING:
    from kvctl.tui.source import DataSource


def top(
    ctx: typer.Context,
    interval: Annotated[
        float, typer.Option("--interval", "-i", min=0.1, max=3600, help="Seconds between polls.")
    ] = 1.0,
    readonly: Annotated[
        bool, typer.Option("--readonly", help="Disable the keys that act (defrag, resize).")
    ] = False,
    once: Annotated[
        bool, typer.Option("--once", "-1", help="Print one snapshot and exit.")
    ] = False,
    headless: Annotated[
        bool,
        typer.Option("--headless", help="No dashboard: print the fleet table every --every s."),
    ] = False,
    duration: Annotated[
        float, typer.Option("--duration", min=0, max=86400, help="Seconds to run with --headless.")
    ] = 60.0,
    every: Annotated[
        float,
        typer.Option("--every", min=0.1, max=3600, help="Seconds between tables (--headless)."),
    ] = 5.0,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
    prometheus: PrometheusOption = None,
    selector: SelectorOption = None,
) -> None:
    """Watch the pool live: the four numbers with history, the page map, requests, alerts.

    Several agents: the fleet table first (s sort, S reverse, / filter, enter opens one).

    One agent: d defrag, r resize, a alerts, w sparkline span, tab next, esc the fleet; on an
    agent serving several models, p shows its next pool (the budget bar splits its memory by
    pool).

    Anywhere: ? help, q quit.

    With --prometheus URL the fleet comes from Prometheus (every node it scrapes, engines
    too); opening a row reads that node directly where this machine can reach it.
    """
    target = resolve(ctx, agent, token, json_out, timeout)
    if headless:
        raise typer.Exit(int(run_headless(target, duration, every, prometheus, selector, agent)))
    if once or target.json or not sys.stdout.isatty():
        readings = read_once(target, prometheus, selector, agent)
        print_status(target, readings)
        raise typer.Exit(int(status_code(readings)))
    if prometheus is not None:
        from kvctl.tui.source import PrometheusSource

        first = read_once(target, prometheus, selector, agent)  # the nodes it starts with
        wait = min(target.timeout, max(interval, 2.0))
        source = PrometheusSource(prometheus, selector, target.token, wait, first)
        run_dashboard(source, interval, readonly)
        return
    if selector is not None:
        fail("--selector narrows --prometheus; give --prometheus URL too", ExitCode.USAGE)
    run_dashboard(http_source(target, interval), interval, readonly)


def http_source(target: Target, interval: float) -> DataSource:
    from kvctl.tui.source import HttpSource

    return HttpSource(target.agents, target.token, min(target.timeout, max(interval, 2.0)))


def run_dashboard(source: DataSource, interval: float, readonly: bool) -> None:
    from kvctl.tui.app import TopApp

    TopApp(source, interval=interval, readonly=readonly).run()


def run_headless(
    target: Target,
    duration: float,
    every: float,
    prometheus: str | None = None,
    selector: str | None = None,
    agent: list[str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> ExitCode:
    """The fleet table at 0, every, 2·every, … ≤ duration s after the start (no drift)."""
    from kvctl.fleet import json_entries

    start = clock()
    code = ExitCode.OK
    tick = 0
    while tick * every <= duration:
        sleep(max(0.0, start + tick * every - clock()))
        readings = read_once(target, prometheus, selector, agent)
        code = status_code(readings)
        if target.json:
            entries = json_entries(readings)
            print_json({"time": time.time(), "agents": entries}, lines=True)
        else:
            out = console()
            stamp = datetime.now().strftime("%H:%M:%S")
            out.print(Rule(f"kvctl top · {stamp} · +{clock() - start:.0f} s", align="left"))
            out.print(render.FleetTable(readings))
        tick += 1
    return code
