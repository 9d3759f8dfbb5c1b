"""How commands print: rich for people, plain JSON for scripts, one line on stderr for errors.

A command that acts on each agent returns `Outcome`s; `finish` prints them and picks the exit
code. With one agent `--json` prints the API model itself, so `kvctl pool show --json | jq
.used_pages` works; with several it prints a list of `{"agent", "result"}` or
`{"agent", "error"}` in `--agent` order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import typer
from rich.console import Console, RenderableType
from rich.rule import Rule

from kvctl.cli.options import ExitCode, Target, fail
from kvctl.view.untrusted import PROSE_LIMIT, clean, safe

if TYPE_CHECKING:
    from kvctl.client import AgentClient, AgentError

T = TypeVar("T")


def console() -> Console:
    """A console on the current stdout (CliRunner swaps it), never wrapping below 100 columns."""
    out = Console(soft_wrap=False, highlight=False)
    if not out.is_terminal:
        out.width = max(out.width, 120)
    return out


def print_json(data: Any, lines: bool = False) -> None:
    """`data` as JSON on stdout (indented, or one line each with `lines`); models as API JSON."""
    typer.echo(json.dumps(to_jsonable(data), indent=None if lines else 2))


def to_jsonable(data: Any) -> Any:
    if hasattr(data, "model_dump"):
        return data.model_dump(mode="json")
    if isinstance(data, list | tuple):
        return [to_jsonable(item) for item in data]
    if isinstance(data, dict):
        return {key: to_jsonable(value) for key, value in data.items()}
    return data


def exit_code_of(error: AgentError) -> ExitCode:
    from kvctl.client import AgentUnauthorized, AgentUnreachable

    if isinstance(error, AgentUnreachable):
        return ExitCode.UNREACHABLE
    if isinstance(error, AgentUnauthorized):
        return ExitCode.UNAUTHORIZED
    return ExitCode.ERROR


def report_error(error: AgentError) -> None:
    """One line on stderr; the message may quote the agent's answer, so it is escaped."""
    typer.echo(f"kvctl: {clean(error, PROSE_LIMIT)}", err=True)


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What one agent did with one request."""

    agent: str
    result: T | None = None
    error: AgentError | None = None


def on_agent(target: Target, agent: str, action: Callable[[AgentClient], T]) -> Outcome[T]:
    """Run `action` on one agent, keeping its error rather than raising it."""
    from kvctl.client import AgentError

    with target.client(agent) as client:
        try:
            return Outcome(agent, result=action(client))
        except AgentError as error:
            return Outcome(agent, error=error)


def on_each(target: Target, action: Callable[[AgentClient], T]) -> list[Outcome[T]]:
    """Run `action` on every agent in turn; a failing agent does not stop the others."""
    return [on_agent(target, agent, action) for agent in target.agents]


def first_failure(outcomes: Sequence[Outcome[Any]]) -> ExitCode:
    for outcome in outcomes:
        if outcome.error is not None:
            return exit_code_of(outcome.error)
    return ExitCode.OK


def finish(
    target: Target,
    outcomes: Sequence[Outcome[T]],
    render: Callable[[T], RenderableType],
    as_json: Callable[[T], Any] = to_jsonable,
) -> None:
    """Print every outcome (JSON or rich), errors on stderr, and exit with the first failure."""
    if target.json:
        _print_outcomes_json(target, outcomes, as_json)
    else:
        out = console()
        for outcome in outcomes:
            if outcome.result is not None:
                if target.fleet:
                    out.print(Rule(safe(outcome.agent), align="left"))
                out.print(render(outcome.result))
    for outcome in outcomes:
        if outcome.error is not None:
            report_error(outcome.error)
    code = first_failure(outcomes)
    if code:
        raise typer.Exit(int(code))


def _print_outcomes_json(
    target: Target, outcomes: Sequence[Outcome[T]], as_json: Callable[[T], Any]
) -> None:
    if not target.fleet:
        if outcomes[0].result is not None:
            print_json(as_json(outcomes[0].result))
        return
    print_json(
        [
            {"agent": o.agent, "result": as_json(o.result)}
            if o.result is not None
            else {"agent": o.agent, "error": str(o.error)}
            for o in outcomes
        ]
    )


def confirm(question: str, yes: bool) -> None:
    """Ask `question` (default no) unless `--yes`; a no (or no answer) changes nothing."""
    if yes:
        return
    try:
        agreed = typer.confirm(question, default=False, err=True)
    except typer.Abort:  # end of input: no one to ask (no terminal, a script)
        fail(
            "no answer to confirm with; nothing changed (add --yes to go ahead)", ExitCode.CANCELLED
        )
    if not agreed:
        fail("cancelled; nothing changed", ExitCode.CANCELLED)


def only_one(target: Target, what: str) -> str:
    """The single agent of a command that cannot act on a fleet, or a usage error."""
    if target.fleet:
        fail(f"{what} talks to one agent; give a single --agent", ExitCode.USAGE)
    return target.agents[0]
