"""The `kvctl` entry point: the root typer app and the list of its commands.

`kvctl --help` must answer in well under a second on a machine with no GPU, so this module and
the command modules it imports load nothing heavy at import time: no numpy, no torch, no
`kvctl.agent`. A command that needs such code imports it inside its function.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from kvctl import __version__
from kvctl.cli.simulate import simulate

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


# Commands, one registration per line.
app.command("simulate")(simulate)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code; errors become one line on stderr, never a traceback."""
    try:
        app(args=argv, prog_name="kvctl")
    except SystemExit as stop:
        return _exit_code(stop.code)
    except Exception as error:
        typer.echo(f"kvctl: error: {error or type(error).__name__}", err=True)
        return 1
    return 0


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
