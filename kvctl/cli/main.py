"""The `kvctl` entry point: the root typer app and the list of its commands.

`kvctl --help` must answer in well under a second on a machine with no GPU, so this module and
the command modules it imports load nothing heavy at import time: no numpy, no torch, no
`kvctl.agent`. A command that needs such code imports it inside its function.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
import typer.main

from kvctl import __version__
from kvctl.cli.agent import agent_app
from kvctl.cli.alerts import alerts_app
from kvctl.cli.config import config_app
from kvctl.cli.defrag import defrag
from kvctl.cli.levers import sleep, wake
from kvctl.cli.load import load
from kvctl.cli.options import (
    DEFAULT_TIMEOUT,
    AgentOption,
    GlobalOptions,
    JsonOption,
    TokenOption,
)
from kvctl.cli.pool import pool_app
from kvctl.cli.prefix import prefix_app
from kvctl.cli.simulate import simulate
from kvctl.cli.status import status
from kvctl.cli.top import top
from kvctl.command_help import flowing

app = typer.Typer(
    name="kvctl",
    help=(
        "See and steer the KV-cache memory of LLM inference: "
        "a paged pool with defragmentation and prefix reuse."
    ),
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    """Print the version and stop before any command runs (an eager option)."""
    if value:
        typer.echo(f"kvctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: Annotated[
        float,
        typer.Option("--timeout", min=0.1, metavar="SECONDS", help="Wait this long per answer."),
    ] = DEFAULT_TIMEOUT,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print the version and exit.",
            callback=_print_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """Options that apply before any command."""
    ctx.obj = GlobalOptions(tuple(agent or ()), token, json_out, timeout)


# Commands, one registration per line.
app.command("status")(status)
app.command("top")(top)
app.command("defrag")(defrag)
app.command("sleep")(sleep)
app.command("wake")(wake)
app.add_typer(pool_app, name="pool")
app.add_typer(prefix_app, name="prefix")
app.add_typer(alerts_app, name="alerts")
app.add_typer(config_app, name="config")
app.command("load")(load)
app.command("simulate")(simulate)
app.add_typer(agent_app, name="agent")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code; errors become one line on stderr, never a traceback."""
    try:
        # Not standalone: usage errors come back here to be printed as one line, and an
        # `Exit(code)` comes back as the return value.
        command = flowing(typer.main.get_command(app))
        code = command(args=argv, prog_name="kvctl", standalone_mode=False)
    except typer.Abort:
        typer.echo("kvctl: aborted", err=True)
        return 5
    except typer.TyperException as error:  # bad usage: typer's own copy of click's exceptions
        message = error.format_message() if hasattr(error, "format_message") else str(error)
        if not message:  # `kvctl` alone: the help was the answer
            return 0
        typer.echo(f"kvctl: error: {message.rstrip('.')}; see kvctl --help", err=True)
        return getattr(error, "exit_code", 2)
    except SystemExit as stop:
        return _exit_code(stop.code)
    except Exception as error:
        from kvctl.view.untrusted import PROSE_LIMIT, clean

        typer.echo(f"kvctl: error: {clean(error or type(error).__name__, PROSE_LIMIT)}", err=True)
        return 1
    return code if isinstance(code, int) else 0


def _exit_code(code: object) -> int:
    """Map a SystemExit payload to an int the shell understands."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    typer.echo(str(code), err=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
