"""`kvctl simulate`: replay a synthetic workload against contiguous and paged KV allocation.

Plain Python on top of the pool's bookkeeping (no torch), so a run needs no GPU. The
`tiered-prefix` scenario (`kvctl.simulate.tiered`) drives the agent's own scheduler, prefix cache
and host tier on CPU tensors; it is imported only when that scenario runs.

`kvctl.simulate.runner` is the stepping library every scenario shares and runs the three
allocation scenarios; `kvctl.simulate.scenarios` picks the module that runs a scenario by name.
"""

from kvctl.simulate.contiguous import ArenaStats, ContiguousAllocator, OutOfMemory
from kvctl.simulate.names import BUDGET, TIERED
from kvctl.simulate.runner import RESULT_KEYS, SimulationConfig, SimulationResult
from kvctl.simulate.scenarios import run_scenario
from kvctl.simulate.workloads import SCENARIOS, Model, Request, Workload, build_workload

__all__ = [
    "BUDGET",
    "RESULT_KEYS",
    "SCENARIOS",
    "TIERED",
    "ArenaStats",
    "ContiguousAllocator",
    "Model",
    "OutOfMemory",
    "Request",
    "SimulationConfig",
    "SimulationResult",
    "Workload",
    "build_workload",
    "run_scenario",
]
