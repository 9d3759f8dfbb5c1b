"""What one fleet row shows, whatever the node: a kvctl agent, an engine, or Prometheus's record.

A kvctl agent answers every field; vLLM, SGLang and TensorRT-LLM export some of them, and a
field a source does not export stays None, which every view prints as "–". Nothing here is
estimated: an engine that reports no fragmentation has none to show, not a zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvctl.api import PoolSnapshot


@dataclass(frozen=True)
class Figures:
    """One node's (or one pool's) figures at one moment; None: not exported by its source."""

    alloc_success_ratio: float | None = None
    fragmentation_ratio: float | None = None
    utilization_ratio: float | None = None
    """KV memory in use, 0..1, as its source counts it (see `pressure_ratio`)."""
    pressure_ratio: float | None = None
    """Memory held by running requests only (cached prefix pages are reclaimable); the colour
    of utilisation. Engines that count cached blocks as free report this as their usage."""
    prefix_hit_ratio: float | None = None
    prefix_span: str | None = None
    """What the prefix hit ratio is taken over: "60 s", "5m", "since start"."""
    requests_running: int | None = None
    requests_waiting: int | None = None
    preemptions: float | None = None
    """Requests preempted (or retracted) to free KV memory over `preemptions_span`."""
    preemptions_span: str | None = None
    capacity_tokens: int | None = None
    """Tokens of KV the node can hold (blocks × tokens per block)."""
    capacity_bytes: int | None = None
    """Its KV memory, where the source says (kvctl does; the engines report blocks)."""
    block_tokens: int | None = None
    blocks: int | None = None


def pool_figures(pool: PoolSnapshot) -> Figures:
    """A kvctl pool's figures, as its agent reports them."""
    return Figures(
        alloc_success_ratio=pool.alloc_success_ratio,
        fragmentation_ratio=pool.fragmentation_ratio,
        utilization_ratio=pool.utilization_ratio,
        pressure_ratio=pool.pressure_ratio,
        prefix_hit_ratio=pool.prefix_hit_ratio if pool.prefix_cache_enabled else None,
        prefix_span=f"{pool.window_seconds:g} s" if pool.prefix_cache_enabled else "off",
        requests_running=pool.requests_running,
        requests_waiting=pool.requests_waiting,
        preemptions=pool.preemptions_total,
        preemptions_span="since start",
        capacity_tokens=pool.capacity_pages * pool.page_size,
        capacity_bytes=pool.capacity_bytes,
        block_tokens=pool.page_size,
        blocks=pool.capacity_pages,
    )


def ratio(hits: float | None, queries: float | None) -> float | None:
    """hits / queries, None when nothing was asked (a ratio of nothing is not 0 % or 100 %)."""
    if hits is None or queries is None or queries <= 0:
        return None
    return min(1.0, max(0.0, hits / queries))
