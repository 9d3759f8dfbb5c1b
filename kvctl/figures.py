"""What one fleet row shows, whatever the node: a kvctl agent, an engine, or Prometheus's record.

A kvctl agent answers every field; vLLM, SGLang and TensorRT-LLM export some of them, and a
field a source does not export stays None, which every view prints as "–". Nothing here is
estimated: an engine that reports no fragmentation has none to show, not a zero.

Nor is anything nonsensical shown: a source's NaN, ±Inf, negative count or ratio outside 0..1
becomes None too (`from_source`), with a note saying what the source reported, so a broken or
hostile node costs its own cells and never the fleet's table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    """A kvctl pool's figures, as its agent reports them; a sleeping model's pool holds no
    pages, so it has no fragmentation, utilisation or pressure ("–", not 0)."""
    awake = pool.sleep.state == "awake"
    return Figures(
        alloc_success_ratio=pool.alloc_success_ratio,
        fragmentation_ratio=pool.fragmentation_ratio if awake else None,
        utilization_ratio=pool.utilization_ratio if awake else None,
        pressure_ratio=pool.pressure_ratio if awake else None,
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


RATIOS = frozenset(
    {
        "alloc_success_ratio",
        "fragmentation_ratio",
        "utilization_ratio",
        "pressure_ratio",
        "prefix_hit_ratio",
    }
)
WHOLE = frozenset(
    {
        "requests_running",
        "requests_waiting",
        "capacity_tokens",
        "capacity_bytes",
        "block_tokens",
        "blocks",
    }
)
"""Counts shown as whole numbers; `preemptions` (an increase over a window) may be fractional."""


def sane(name: str, value: float | None) -> tuple[float | None, str | None]:
    """`value` of figure (or counter) `name` if it can be one, else None and the note that says
    what the source reported: NaN and ±Inf never, a ratio in 0..1, anything else at least 0."""
    if value is None:
        return None, None
    what = name.removesuffix("_ratio").replace("_", " ")
    if math.isnan(value):
        said = "NaN"
    elif math.isinf(value):
        said = "+Inf" if value > 0 else "-Inf"
    elif name in RATIOS and not 0.0 <= value <= 1.0:
        said = f"{value:g}, outside 0..1"
    elif name not in RATIOS and value < 0:
        said = f"{value:g}, below zero"
    else:
        return value, None
    return None, f"{what}: the source reported {said}; shown as –"


def from_source(
    values: Mapping[str, float | None], **spans: str | None
) -> tuple[Figures, tuple[str, ...]]:
    """Figures from a source's raw numbers (keyed by field) and spans, with a note for each
    number left out as nonsense (`sane`); tokens of capacity are blocks × tokens per block
    where the source gives no token count."""
    fields: dict[str, Any] = dict(spans)
    notes = []
    for name, raw in values.items():
        value, note = sane(name, raw)
        if note is not None:
            notes.append(note)
        fields[name] = round(value) if value is not None and name in WHOLE else value
    block_tokens, blocks = fields.get("block_tokens"), fields.get("blocks")
    if fields.get("capacity_tokens") is None and block_tokens is not None and blocks is not None:
        fields["capacity_tokens"] = block_tokens * blocks
    return Figures(**fields), tuple(notes)


def ratio(hits: float | None, queries: float | None) -> float | None:
    """hits / queries, None when nothing was asked (a ratio of nothing is not 0 % or 100 %)
    or either is not a number."""
    if hits is None or queries is None or queries <= 0:
        return None
    if not (math.isfinite(hits) and math.isfinite(queries)):
        return None
    return min(1.0, max(0.0, hits / queries))
