"""Engine-level prefix tests use a smaller pool than the runtime tests, so that eviction
happens."""

import pytest
from kv_device import DEVICE


@pytest.fixture
def engine_defaults() -> dict:
    return {"page_size": 4, "pool_pages": 128, "segment_pages": 16, "device": DEVICE}
