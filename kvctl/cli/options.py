"""The options every command shares (`--agent`, `--token`, `--json`, `--timeout`) and the exit
codes.

Each of them can be given before the command (`kvctl --agent URL status`) or after it
(`kvctl status --agent URL`), as kubectl users expect; the one after the command wins, then the
one before, then the environment (`KVCTL_AGENT`, comma-separated; `KVCTL_TOKEN`), then the
default agent on this machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

if TYPE_CHECKING:
    from kvctl.client import AgentClient

DEFAULT_AGENT = "http://127.0.0.1:8477"
DEFAULT_TIMEOUT = 10.0
"""Also in kvctl.client (a test keeps them equal); here so `kvctl --help` does not load httpx."""


class ExitCode(IntEnum):
    """What `kvctl` returns; scripts may rely on these (documented in the README)."""

    OK = 0
    ERROR = 1
    """An agent refused or failed (a refused resize, a rejected value, an internal error), or
    another step failed."""
    USAGE = 2
    """Bad arguments; nothing was sent."""
    UNREACHABLE = 3
    """An agent did not answer (not running, wrong URL, timed out, connection dropped)."""
    UNAUTHORIZED = 4
    """An agent wants a token: `--token` or `KVCTL_TOKEN` is missing or wrong."""
    CANCELLED = 5
    """The answer to a confirmation was no; nothing changed."""


AgentOption = Annotated[
    list[str] | None,
    typer.Option(
        "--agent",
        "-a",
        metavar="URL",
        help="Agent to talk to; repeat for a fleet. \\[env: KVCTL_AGENT, comma-separated; "
        f"default: {DEFAULT_AGENT}]",
        show_default=False,
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        metavar="TOKEN",
        help="Bearer token of agents started with --token-file. \\[env: KVCTL_TOKEN]",
        show_default=False,
    ),
]
PrometheusOption = Annotated[
    str | None,
    typer.Option(
        "--prometheus",
        metavar="URL",
        help="Read the fleet from this Prometheus (a few queries for every node it scrapes) "
        "instead of asking each --agent. \\[env: KVCTL_PROMETHEUS]",
        envvar="KVCTL_PROMETHEUS",
        show_envvar=False,
        show_default=False,
    ),
]
SelectorOption = Annotated[
    str | None,
    typer.Option(
        "--selector",
        metavar="MATCHERS",
        help="With --prometheus: only the series these label matchers select, e.g. "
        "'{job=\"vllm\"}'.",
        show_default=False,
    ),
]
JsonOption = Annotated[
    bool,
    typer.Option("--json", help="Print JSON (the API's models) instead of tables."),
]
TimeoutOption = Annotated[
    float | None,
    typer.Option(
        "--timeout",
        min=0.1,
        metavar="SECONDS",
        help=f"Wait this long per answer. \\[default: {DEFAULT_TIMEOUT:g}]",
        show_default=False,
    ),
]
YesOption = Annotated[
    bool,
    typer.Option("--yes", "-y", help="Do not ask for confirmation."),
]
PoolOption = Annotated[
    str | None,
    typer.Option(
        "--pool",
        metavar="NAME",
        help="The pool of model NAME, on an agent that serves several models "
        "\\[default: its only pool].",
        show_default=False,
    ),
]
EveryPoolOption = Annotated[
    str | None,
    typer.Option(
        "--pool",
        metavar="NAME",
        help="Only the pool of model NAME \\[default: every pool of the agent].",
        show_default=False,
    ),
]


@dataclass(frozen=True)
class GlobalOptions:
    """What was given before the command name."""

    agents: tuple[str, ...] = ()
    token: str | None = None
    json: bool = False
    timeout: float = DEFAULT_TIMEOUT


@dataclass(frozen=True)
class Target:
    """The agents a command acts on and how to talk to them."""

    agents: tuple[str, ...]
    token: str | None
    json: bool
    timeout: float

    def client(self, agent: str) -> AgentClient:
        """A client of the kvctl agent at `agent`; a usage error for an engine's URL, which
        `status` and `top` read but nothing acts on."""
        from kvctl.client import AgentClient
        from kvctl.engines import KVCTL, engine_named, split_engine

        engine, url = split_engine(agent)
        if engine not in (None, KVCTL):
            title = engine_named(engine).title
            fail(
                f"{agent}: {title} is read by `kvctl status` and `kvctl top` only; this "
                "command acts on kvctl agents",
                ExitCode.USAGE,
            )
        return AgentClient(url, self.token, self.timeout)

    @property
    def fleet(self) -> bool:
        return len(self.agents) > 1


def fail(message: str, code: ExitCode | int) -> NoReturn:
    """Stop with one line on stderr; the message says what to do. It may quote a source (a
    Prometheus's or an Alertmanager's answer), so it is escaped (`untrusted.clean`)."""
    from kvctl.view.untrusted import PROSE_LIMIT, clean

    typer.echo(f"kvctl: {clean(message, PROSE_LIMIT)}", err=True)
    raise typer.Exit(int(code))


def _env_agents() -> list[str]:
    return [part for part in os.environ.get("KVCTL_AGENT", "").split(",") if part.strip()]


def _agent_urls(given: list[str]) -> tuple[str, ...]:
    """Each URL normalised, an engine's prefix (`vllm+http://...`) kept for the readers."""
    from kvctl.client import normalize_url
    from kvctl.engines import split_engine

    urls: list[str] = []
    for text in given:
        try:
            engine, plain = split_engine(text)
            url = normalize_url(plain)
            url = url if engine is None else f"{engine}+{url}"
        except ValueError as error:
            fail(f"--agent: {error}", ExitCode.USAGE)
        if url not in urls:
            urls.append(url)
    return tuple(urls)


def resolve(
    ctx: typer.Context,
    agent: list[str] | None = None,
    token: str | None = None,
    json_out: bool = False,
    timeout: float | None = None,
) -> Target:
    """Merge the command's options with the ones before it, the environment and defaults."""
    root = ctx.find_root().obj
    before = root if isinstance(root, GlobalOptions) else GlobalOptions()
    given = agent or list(before.agents) or _env_agents() or [DEFAULT_AGENT]
    return Target(
        agents=_agent_urls(given),
        token=token or before.token or os.environ.get("KVCTL_TOKEN") or None,
        json=json_out or before.json,
        timeout=timeout or before.timeout,
    )
