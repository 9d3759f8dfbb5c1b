"""Sparklines on a fixed 0..1 scale: a ratio that sits at 100 % draws a full bar, not a
mid-height line as min/max-scaled sparklines do, so a glance says where the value is."""

from __future__ import annotations

from collections.abc import Sequence

BARS = "▁▂▃▄▅▆▇█"


def sparkline(
    values: Sequence[float | None], width: int, low: float = 0.0, high: float = 1.0
) -> str:
    """The last `width` values as bars, oldest first; gaps (None) as spaces."""
    if width <= 0:
        return ""
    span = (high - low) or 1.0
    chars = []
    for value in list(values)[-width:]:
        if value is None:
            chars.append(" ")
            continue
        level = min(1.0, max(0.0, (value - low) / span))
        chars.append(BARS[round(level * (len(BARS) - 1))])
    return "".join(chars)
