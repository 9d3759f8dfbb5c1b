"""The figures derived from a pool's page counts: one definition of each ratio and byte count.

The pool core's reading (`kvctl.agent.pool.stats.PoolOccupancy`, a plain dataclass) and the
API's model (`kvctl.api.PoolOccupancy`, what the JSON carries) both compute them here, so the
allocator, the metrics, the alerts and the wire can never disagree. Pure Python, importing
nothing: the CLI loads it with `kvctl.api` without touching the agent.
"""

from __future__ import annotations


def pages_bytes(pages: int, bytes_per_page: int) -> int:
    """pages × bytes_per_page (`capacity_bytes`, `used_bytes`)."""
    return pages * bytes_per_page


def utilization_of(used_pages: int, cached_pages: int, capacity_pages: int) -> float:
    """(used + cached) / capacity: how much of the pool holds K/V at all; 0 for no pages."""
    if capacity_pages == 0:
        return 0.0
    return (used_pages + cached_pages) / capacity_pages


def pressure_of(used_pages: int, capacity_pages: int) -> float:
    """used / capacity: cached pages are evicted on demand, so only used pages count."""
    if capacity_pages == 0:
        return 0.0
    return used_pages / capacity_pages


def free_run_pages_of(free_pages: int, reserved_pages: int) -> int:
    """Free pages in the free extents: all free pages but those reserved for growth."""
    return free_pages - reserved_pages


def fragmentation_of(largest_free_run: int, free_pages: int) -> float:
    """1 - largest free run / free pages; 0 when nothing is free."""
    if free_pages == 0:
        return 0.0
    return 1.0 - largest_free_run / free_pages
