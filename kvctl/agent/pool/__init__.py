"""The paged KV pool: plain-Python bookkeeping (no torch) plus a torch storage layer.

Import the bookkeeping from here; import `kvctl.agent.pool.storage` only where tensors are needed.
"""

from kvctl.agent.pool.auto_defrag import AutoDefrag
from kvctl.agent.pool.defrag import (
    Defragmenter,
    DefragReport,
    DefragTrigger,
    PageCopier,
    moves_needed,
    plan_moves,
)
from kvctl.agent.pool.errors import (
    InvariantViolated,
    PoolCorrupted,
    PoolError,
    PoolExhausted,
    ResizeRefused,
    UnknownSequence,
)
from kvctl.agent.pool.extents import FreeExtents
from kvctl.agent.pool.page_pool import CopyOnWrite, PagePool, PageTable
from kvctl.agent.pool.resize import PoolResizer, ResizeResult, SegmentStore
from kvctl.agent.pool.stats import PageRun, PageState, PoolOccupancy

__all__ = [
    "AutoDefrag",
    "CopyOnWrite",
    "DefragReport",
    "DefragTrigger",
    "Defragmenter",
    "FreeExtents",
    "InvariantViolated",
    "PageCopier",
    "PagePool",
    "PageRun",
    "PageState",
    "PageTable",
    "PoolCorrupted",
    "PoolError",
    "PoolExhausted",
    "PoolOccupancy",
    "PoolResizer",
    "ResizeRefused",
    "ResizeResult",
    "SegmentStore",
    "UnknownSequence",
    "moves_needed",
    "plan_moves",
]
