"""`kvctl status`: one agent in detail, or a fleet as one row per agent and pool.

An agent serving several models shows the budget its pools share and one row per pool.
Exits non-zero when any agent is down, so `kvctl status -a node1 -a node2 || page-someone` works;
the reason for each down agent is also one line on stderr.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import typer

from kvctl.cli.options import (
    AgentOption,
    ExitCode,
    JsonOption,
    Target,
    TimeoutOption,
    TokenOption,
    resolve,
)
from kvctl.cli.output import console, exit_code_of, print_json, report_error
from kvctl.view import render

if TYPE_CHECKING:
    from kvctl.fleet import Reading


def status(
    ctx: typer.Context,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Show the pool, the four headline numbers and the alerts of each agent (every pool of
    an agent that serves several models, with the budget they share)."""
    from kvctl.fleet import read_fleet_once

    target = resolve(ctx, agent, token, json_out, timeout)
    readings = read_fleet_once(target.agents, target.token, target.timeout)
    print_status(target, readings)
    raise typer.Exit(int(status_code(readings)))


def print_status(target: Target, readings: Sequence[Reading]) -> None:
    """The readings as JSON (`{"agents": [...]}`, one entry per agent and pool) or rich, and
    each down agent's reason."""
    from kvctl.fleet import json_entries

    if target.json:
        print_json({"agents": json_entries(readings)})
    else:
        console().print(render.status(readings))
    for reading in readings:
        if reading.error is not None:
            report_error(reading.error)


def status_code(readings: Sequence[Reading]) -> ExitCode:
    """The first down agent's code (unreachable, unauthorized, ...), else OK."""
    for reading in readings:
        if reading.error is not None:
            return exit_code_of(reading.error)
    return ExitCode.OK
