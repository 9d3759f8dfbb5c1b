"""The names of the two scenarios with their own modules, in a module that imports nothing.

`kvctl.simulate.scenarios` dispatches on them and `kvctl.simulate.tiered` and
`kvctl.simulate.budget` put them in their results, so each reads them here instead of from the
other (the three allocation scenarios are named by `kvctl.simulate.workloads.SCENARIOS`).
"""

TIERED = "tiered-prefix"
"""The scenario of `kvctl.simulate.tiered` (multi-turn chat without and with a host tier); it
drives the agent's scheduler and tiers, which need torch, so it is imported only when run."""

BUDGET = "budget"
"""The scenario of `kvctl.simulate.budget` (three models' pools sharing one budget, a static
split against the agent's rebalancer), imported only when run; its own sides and fields."""
