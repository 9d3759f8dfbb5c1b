"""The torch device the tests put models and KV storage on: `KVCTL_DEVICE` (default `cpu`).

`KVCTL_DEVICE=cuda pytest tests/pool tests/model tests/runtime tests/prefix` runs the pool,
storage, model and engine tests on a GPU; reference models from transformers stay on the CPU and
results are compared there.
"""

import os

DEVICE: str = os.environ.get("KVCTL_DEVICE", "cpu")
