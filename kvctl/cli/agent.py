"""`kvctl agent run`: start the agent, exactly as `kvctl-agent` does.

The process replaces itself with `python -m kvctl.agent.startup.main`, so the agent gets the same
arguments, signals (SIGTERM stops it cleanly) and exit code, and the CLI never imports the
agent's code (which loads torch).
"""

from __future__ import annotations

import os
import sys

import typer

from kvctl.cli.options import ExitCode, fail

AGENT_MODULE = "kvctl.agent.startup.main"

agent_app = typer.Typer(
    help="Run the per-node agent (same as kvctl-agent).",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


@agent_app.command(
    "run",
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        "help_option_names": [],
    },
)
def run(ctx: typer.Context) -> None:
    """Start kvctl-agent with these arguments; `kvctl agent run --help` lists them."""
    argv = [sys.executable, "-m", AGENT_MODULE, *ctx.args]
    try:
        os.execv(sys.executable, argv)
    except OSError as error:
        fail(
            f"cannot start {AGENT_MODULE} ({error}); is kvctl installed in this Python?",
            ExitCode.ERROR,
        )
