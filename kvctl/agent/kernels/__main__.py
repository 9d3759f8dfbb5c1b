"""`python -m kvctl.agent.kernels`: build the CPU kernels now (`make setup` does) or say why not."""

import logging

from kvctl.agent.kernels import cpu_ops, unavailable_reason

logging.basicConfig(level=logging.INFO, format="%(message)s")
print("CPU kernels:", "ready" if cpu_ops() is not None else f"off ({unavailable_reason()})")
