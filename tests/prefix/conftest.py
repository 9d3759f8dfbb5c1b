"""Fixtures of the engine-level prefix tests: the demo model and engines built around it."""

from collections.abc import Callable

import pytest
import torch

from kvctl.agent.model import build_demo_model
from kvctl.agent.pool import DefragPolicy
from kvctl.agent.runtime import Engine, EngineConfig

MakeEngine = Callable[..., Engine]


@pytest.fixture(scope="session")
def demo() -> tuple:
    return build_demo_model("cpu", torch.float32, seed=0)


@pytest.fixture
def make_engine(demo) -> MakeEngine:
    """An engine on the demo model with a tiny page size; keyword arguments override
    `EngineConfig` fields."""
    _, model, tokenizer = demo

    def make(**overrides) -> Engine:
        settings = {
            "page_size": 4,
            "pool_pages": 128,
            "segment_pages": 16,
            "defrag": DefragPolicy(enabled=False),
        }
        settings.update(overrides)
        return Engine(model, tokenizer, EngineConfig(**settings))

    return make
