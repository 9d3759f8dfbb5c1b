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
from typing import Annotated

import typer
from rich.rule import Rule

from kvctl.cli.options import (
    AgentOption,
    ExitCode,
    JsonOption,
    Target,
    TimeoutOption,
    TokenOption,
    resolve,
)
from kvctl.cli.output import console, print_json
from kvctl.cli.status import print_status, status_code
from kvctl.view import render


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
) -> None:
    """Watch the pool live: the four numbers with history, the page map, requests, alerts.

    Several agents: the fleet table first (s sort, S reverse, / filter, enter opens one).

    One agent: d defrag, r resize, a alerts, w sparkline span, tab next, esc the fleet; on an
    agent serving several models, p shows its next pool (the budget bar splits its memory by
    pool).

    Anywhere: ? help, q quit.
    """
    from kvctl.fleet import read_fleet_once

    target = resolve(ctx, agent, token, json_out, timeout)
    if headless:
        raise typer.Exit(int(run_headless(target, duration, every)))
    if once or target.json or not sys.stdout.isatty():
        readings = read_fleet_once(target.agents, target.token, target.timeout)
        print_status(target, readings)
        raise typer.Exit(int(status_code(readings)))
    run_dashboard(target, interval, readonly)


def run_dashboard(target: Target, interval: float, readonly: bool) -> None:
    from kvctl.tui.app import TopApp
    from kvctl.tui.source import HttpSource

    source = HttpSource(target.agents, target.token, min(target.timeout, max(interval, 2.0)))
    TopApp(source, interval=interval, readonly=readonly).run()


def run_headless(
    target: Target,
    duration: float,
    every: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> ExitCode:
    """The fleet table at 0, every, 2·every, … ≤ duration s after the start (no drift)."""
    from kvctl.fleet import json_entries, read_fleet_once

    start = clock()
    code = ExitCode.OK
    tick = 0
    while tick * every <= duration:
        sleep(max(0.0, start + tick * every - clock()))
        readings = read_fleet_once(target.agents, target.token, target.timeout)
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
