"""`kvctl status`: one agent in detail, or a fleet as one row per agent and pool.

An agent serving several models shows the budget its pools share and one row per pool. An
engine (vLLM, SGLang, TensorRT-LLM) given as `--agent` is read from its /metrics; with
`--prometheus URL` the whole fleet is read from Prometheus instead, a few queries in all.
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
    PrometheusOption,
    SelectorOption,
    Target,
    TimeoutOption,
    TokenOption,
    fail,
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
    prometheus: PrometheusOption = None,
    selector: SelectorOption = None,
) -> None:
    """Show the pool, the four headline numbers and the alerts of each agent (every pool of
    an agent that serves several models, with the budget they share); of an engine, what its
    /metrics exports ("–" for the rest)."""
    target = resolve(ctx, agent, token, json_out, timeout)
    readings = read_once(target, prometheus, selector, agent)
    print_status(target, readings)
    raise typer.Exit(int(status_code(readings)))


def read_once(
    target: Target, prometheus: str | None, selector: str | None, agent: list[str] | None
) -> list[Reading]:
    """Every node of the fleet once: from Prometheus when `prometheus` is given, else from
    each `--agent`. A bad selector or an unreachable Prometheus is one line and an exit."""
    if prometheus is None:
        if selector is not None:
            fail("--selector narrows --prometheus; give --prometheus URL too", ExitCode.USAGE)
        from kvctl.fleet import read_fleet_once

        return read_fleet_once(target.agents, target.token, target.timeout)
    if agent:
        fail("give --agent or --prometheus, not both", ExitCode.USAGE)
    from kvctl.prometheus_fleet import PrometheusError, read_prometheus_once

    try:
        return read_prometheus_once(prometheus, selector, target.timeout)
    except ValueError as error:
        fail(str(error), ExitCode.USAGE)
    except PrometheusError as error:
        fail(str(error), ExitCode.USAGE if error.refused else ExitCode.UNREACHABLE)


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
