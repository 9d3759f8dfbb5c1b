"""Running `kvctl` in-process (typer's CliRunner) against real agents.

`kvctl(*args)` runs one command with a clean environment (no KVCTL_AGENT or KVCTL_TOKEN from the
developer's shell) and returns the result with `stdout`, `stderr` and `exit_code`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from agent_process import SMALL_POOL, RunningAgent, launch_agent
from typer.testing import CliRunner, Result

from kvctl.cli.main import app

TOKEN = "s3cret-token"


@pytest.fixture
def kvctl() -> Callable[..., Result]:
    def run(*args: str, input: str | None = None, env: dict[str, str] | None = None) -> Result:
        clean: dict[str, str | None] = {"KVCTL_AGENT": None, "KVCTL_TOKEN": None, "COLUMNS": "160"}
        clean.update(env or {})
        return CliRunner().invoke(app, list(args), input=input, env=clean)

    return run


@pytest.fixture(scope="session")
def token_agent(tmp_path_factory) -> Iterator[RunningAgent]:
    """A second agent, started with a token: for auth errors and for two-agent fleets."""
    running = launch_agent(*SMALL_POOL, token=TOKEN, tmp=tmp_path_factory.mktemp("token"))
    yield running
    running.stop()
