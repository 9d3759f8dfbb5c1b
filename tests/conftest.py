"""Shared pytest setup: a hypothesis profile sized for a 2-core CI machine, real agent
processes for the integration tests, and `kvctl(*args)`: one command run in-process (typer's
CliRunner) with a clean environment (no KVCTL_AGENT, KVCTL_TOKEN or KVCTL_PROMETHEUS from the
developer's shell), returning the result with `stdout`, `stderr` and `exit_code`.

Set HYPOTHESIS_PROFILE to pick another registered profile (hypothesis has `default`).
"""

import contextlib
import os
from collections.abc import Callable, Iterator

import pytest
from agent_process import SMALL_POOL, RunningAgent, launch_agent
from hypothesis import settings
from kv_device import DEVICE
from typer.testing import CliRunner, Result


@pytest.fixture
def kvctl() -> Callable[..., Result]:
    from kvctl.cli.main import app

    def run(*args: str, input: str | None = None, env: dict[str, str] | None = None) -> Result:
        clean: dict[str, str | None] = {"KVCTL_AGENT": None, "KVCTL_TOKEN": None, "COLUMNS": "160"}
        clean["KVCTL_PROMETHEUS"] = None
        clean.update(env or {})
        return CliRunner().invoke(app, list(args), input=input, env=clean)

    return run


# No deadline: timing on shared CI machines is noisy, and pytest-timeout bounds each test anyway.
settings.register_profile("ci", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def start_agent(tmp_path) -> Iterator[Callable[..., RunningAgent]]:
    """Factory: `start_agent(*flags, token=None, file_limit=None)`; every agent is stopped at
    teardown."""
    started: list[RunningAgent] = []

    def start(*args: str, token: str | None = None, file_limit: int | None = None) -> RunningAgent:
        agent = launch_agent(*args, token=token, tmp=tmp_path, file_limit=file_limit)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        with contextlib.suppress(Exception):
            agent.stop()


@pytest.fixture(scope="session")
def agent() -> Iterator[RunningAgent]:
    """One agent on the demo model with a small pool, shared by the tests that only read or
    make changes they undo."""
    running = launch_agent(*SMALL_POOL)
    yield running
    running.stop()


# ---- the demo model and engines around it ---------------------------------------------------


@pytest.fixture(scope="session")
def demo() -> tuple:
    """(config, model, tokenizer) of the demo model, built once per session."""
    import torch

    from kvctl.agent.model import build_demo_model

    return build_demo_model(DEVICE, torch.float32, seed=0)


@pytest.fixture
def engine_defaults() -> dict:
    """`EngineConfig` fields of `make_engine`; a directory's conftest may override them."""
    return {"page_size": 4, "pool_pages": 256, "segment_pages": 32, "device": DEVICE}


@pytest.fixture
def make_engine(demo, engine_defaults) -> Callable[..., object]:
    """An engine on the demo model with tiny pages and automatic defrag off; keyword arguments
    override `EngineConfig` fields."""
    from kvctl.agent.runtime import Engine, EngineConfig
    from kvctl.settings import DefragSettings

    _, model, tokenizer = demo

    def make(**overrides: object) -> Engine:
        settings = {**engine_defaults, "defrag": DefragSettings(enabled=False), **overrides}
        return Engine(model, tokenizer, EngineConfig(**settings))

    return make
