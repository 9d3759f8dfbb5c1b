"""`kvctl simulate`'s dispatcher: which module runs a scenario, by its name.

The three allocation scenarios run in `kvctl.simulate.runner`; `TIERED` and `BUDGET` have their
own modules, imported only when they run (the tiered one drives the agent's scheduler, which
needs torch). Nothing imports this module but the package and its callers, so the scenario
modules and the runner they share never import one another in a circle.
"""

from __future__ import annotations

from typing import Any

from kvctl.simulate.names import BUDGET, TIERED
from kvctl.simulate.runner import Progress, run_allocators

__all__ = ["BUDGET", "TIERED", "run_scenario"]


def run_scenario(
    name: str, seed: int, progress: Progress | None = None, **overrides: Any
) -> dict[str, Any]:
    """Run scenario `name` with `seed`; `progress` is told (settled, total) as requests settle.

    The allocation scenarios run `kvctl.simulate.runner.run_allocators` (both allocators under
    the same budget; `overrides` are `SimulationConfig` fields), `TIERED`
    `kvctl.simulate.tiered.run_tiered` and `BUDGET` `kvctl.simulate.budget.run_budget` (each with
    its own sides, settings and fields).
    """
    if name == TIERED:
        from kvctl.simulate.tiered import run_tiered

        return run_tiered(seed, progress, **overrides)
    if name == BUDGET:
        from kvctl.simulate.budget import run_budget

        return run_budget(seed, progress, **overrides)
    return run_allocators(name, seed, progress, **overrides)
