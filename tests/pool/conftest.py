"""The pool tests build their expected page contents with plain tensor factories; on
`KVCTL_DEVICE=cuda` those must land where the storage lives, so they compare on the device."""

from collections.abc import Iterator

import pytest
import torch
from kv_device import DEVICE


@pytest.fixture(autouse=True)
def tensors_on_test_device() -> Iterator[None]:
    previous = torch.get_default_device()
    torch.set_default_device(DEVICE)
    yield
    torch.set_default_device(previous)
