"""`kvctl-agent`: load the model, size the pool, serve the API until SIGTERM.

Start-up refuses bad configuration with one line on stderr and exit code 2 before anything is
allocated; once the socket listens it logs `listening on http://HOST:PORT` (tests and scripts
wait for that line), and SIGTERM lets running requests finish for `shutdown_grace` seconds,
aborts the rest and exits 0.

This module is the command only: its options are generated from the settings' definitions
(kvctl.agent.startup.settings), it reads them into an `AgentConfig` (kvctl.agent.config), and
kvctl.agent.startup.wiring builds and serves what that says (sized by kvctl.agent.startup.planning).
"""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvctl import __version__
from kvctl.agent.config import ConfigError, load_config
from kvctl.agent.startup.settings import setting_parameters
from kvctl.agent.startup.wiring import serve

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

COMMAND_PARAMETERS = [
    inspect.Parameter(
        "config",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            Path | None,
            typer.Option(metavar="FILE", help="TOML file with any of these settings."),
        ],
    ),
    inspect.Parameter(
        "set_",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            list[str] | None,
            typer.Option(
                "--set",
                metavar="SECTION.NAME=VALUE",
                help="A runtime setting, e.g. defrag.fragmentation_threshold=0.4 (repeatable; "
                "docs/settings.md lists them).",
            ),
        ],
    ),
    inspect.Parameter(
        "version",
        inspect.Parameter.KEYWORD_ONLY,
        default=False,
        annotation=Annotated[bool, typer.Option("--version", help="Print the version and exit.")],
    ),
]
"""The command's own options, after every setting's flag."""


def main_command(**options: Any) -> None:
    """Run the kvctl agent: a model on a paged KV pool, with its API, metrics and alerts."""
    if options.pop("version"):
        typer.echo(f"kvctl-agent {__version__}")
        raise typer.Exit(0)
    config_file: Path | None = options.pop("config")
    assignments: list[str] | None = options.pop("set_")
    # typer gives [] for a repeatable flag not given: not given is None, so the file's value holds
    flags = {key: value if value != [] else None for key, value in options.items()}
    try:
        settings = load_config(flags, config_file, assignments)
        logging.basicConfig(
            level=settings.log_level.upper(),
            format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
            stream=sys.stderr,
        )
        code = serve(settings)
    except ConfigError as error:
        typer.echo(f"kvctl-agent: error: {error}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


main_command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # typer reads it
    [*setting_parameters(), *COMMAND_PARAMETERS], return_annotation=None
)
app.command()(main_command)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvctl-agent` and `python -m kvctl.agent.startup.main`."""
    try:
        app(args=argv, prog_name="kvctl-agent", standalone_mode=True)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
