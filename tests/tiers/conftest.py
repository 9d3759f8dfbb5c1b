"""Tier tests use a pool small enough that a few prompts evict each other's prefixes."""

import pytest
from kv_device import DEVICE


@pytest.fixture
def engine_defaults() -> dict:
    return {"page_size": 4, "pool_pages": 32, "segment_pages": 8, "device": DEVICE}
