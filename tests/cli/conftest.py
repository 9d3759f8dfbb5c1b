"""Agents for the CLI tests (`kvctl(*args)`, the in-process runner, is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agent_process import SMALL_POOL, RunningAgent, launch_agent

TOKEN = "s3cret-token"


@pytest.fixture(scope="session")
def token_agent(tmp_path_factory) -> Iterator[RunningAgent]:
    """A second agent, started with a token: for auth errors and for two-agent fleets."""
    running = launch_agent(*SMALL_POOL, token=TOKEN, tmp=tmp_path_factory.mktemp("token"))
    yield running
    running.stop()
