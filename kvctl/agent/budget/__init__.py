"""One KV memory budget for the pools of several models, and the rebalancer that moves memory
between them (`kv_budget`, `rebalancer`)."""

from kvctl.agent.budget.kv_budget import BudgetCorrupted, BudgetedPool, BudgetError, KvBudget
from kvctl.agent.budget.rebalancer import Move, PoolHistory, Pressure, Rebalancer

__all__ = [
    "BudgetCorrupted",
    "BudgetError",
    "BudgetedPool",
    "KvBudget",
    "Move",
    "PoolHistory",
    "Pressure",
    "Rebalancer",
]
