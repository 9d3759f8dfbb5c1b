"""Numbers as operators read them, with the colour of how worried to be.

The thresholds are the agent's alert defaults (`kvctl.api.AlertSettings`), so a number turns red
on the screen where the matching alert would fire. The CLI tables and the TUI both use these.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from kvctl.units import format_bytes

if TYPE_CHECKING:
    from kvctl.api import AlertSettings, PoolSnapshot
    from kvctl.figures import Figures
SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
OK, WARN, BAD, DIM = "green", "yellow", "bold red", "dim"


def percent(ratio: float | None, digits: int = 1) -> str:
    """A 0..1 ratio as a percentage, or "–" when nothing happened to measure."""
    return "–" if ratio is None else f"{100 * ratio:.{digits}f} %"


def seconds(value: float | None) -> str:
    """A duration short enough for a table cell: "850 ms", "12.5 s", "3m20s", "2h05m"."""
    if value is None:
        return "–"
    if value < 1:
        return f"{1000 * value:.0f} ms"
    if value < 60:
        return f"{value:.1f} s"
    minutes, secs = divmod(round(value), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def pages(count: int, bytes_per_page: int) -> str:
    """A page count with its size: "512 pages (8 MiB)"."""
    return f"{count:,} pages ({format_bytes(count * bytes_per_page)})"


@cache
def limits() -> AlertSettings:
    """The agent's default alert thresholds (read once; pydantic loads only when needed)."""
    from kvctl.api import AlertSettings

    return AlertSettings()


def severity_style(severity: str) -> str:
    return SEVERITY_STYLE.get(severity, "")


def success_style(ratio: float | None) -> str:
    if ratio is None:
        return DIM
    return OK if ratio >= limits().alloc_success_min else BAD if ratio < 0.99 else WARN


def fragmentation_style(ratio: float) -> str:
    limit = limits().fragmentation_max
    return BAD if ratio > limit else WARN if ratio > 0.6 * limit else OK


def pressure_style(pressure: float) -> str:
    """The colour of utilisation, read from the pressure (used pages only): cached prefix pages
    are reclaimable, so a pool full of them is healthy, not full."""
    if pressure >= limits().pressure_high:
        return BAD
    return WARN if pressure >= 0.85 * limits().pressure_high else OK


def prefix_style(ratio: float | None, enabled: bool = True) -> str:
    if ratio is None or not enabled:
        return DIM
    return WARN if ratio < limits().prefix_hit_min else OK


@dataclass(frozen=True)
class Headline:
    """One of the four numbers an operator watches: label, value text, style, raw ratio."""

    label: str
    text: str
    style: str
    ratio: float | None


def headlines(pool: PoolSnapshot) -> tuple[Headline, ...]:
    """Allocation success, fragmentation, utilisation, prefix hit rate, in that order."""
    from kvctl.figures import pool_figures

    return figure_headlines(pool_figures(pool))


def figure_headlines(figures: Figures) -> tuple[Headline, ...]:
    """The four numbers of any node, "–" (dimmed) for those its source does not export."""
    prefix = figures.prefix_hit_ratio
    prefix_text = "off" if figures.prefix_span == "off" else percent(prefix)
    frag = figures.fragmentation_ratio
    pressure = figures.pressure_ratio
    return (
        Headline(
            "alloc success",
            percent(figures.alloc_success_ratio, 2),
            success_style(figures.alloc_success_ratio),
            figures.alloc_success_ratio,
        ),
        Headline(
            "fragmentation",
            "–" if frag is None else f"{frag:.2f}",
            DIM if frag is None else fragmentation_style(frag),
            frag,
        ),
        Headline(
            "utilisation",
            percent(figures.utilization_ratio),
            DIM if pressure is None else pressure_style(pressure),
            figures.utilization_ratio,
        ),
        Headline(
            "prefix hits",
            prefix_text,
            prefix_style(prefix, figures.prefix_span != "off"),
            prefix,
        ),
    )


def counted(number: int, noun: str) -> str:
    """`number` of `noun` with thousands separators, the noun plural unless there is one:
    "1 free extent", "1,024 pages"."""
    return f"{number:,} {noun}" if number == 1 else f"{number:,} {noun}s"


def count(value: float | None) -> str:
    """A count for a cell, "–" where the source exports none."""
    return "–" if value is None else f"{value:,.0f}"


def per_token(seconds: float | None) -> str:
    """A cost per token, in the unit that keeps it short: "3.95 µs", "106 µs", "1.2 ms"."""
    if seconds is None:
        return "–"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def byte_rate(per_second: float | None) -> str:
    """Bytes per second in binary units: "12.3 MiB/s"; "–" without two readings."""
    return "–" if per_second is None else f"{format_bytes(per_second)}/s"


def token_rate(per_second: float | None) -> str:
    """Tokens per second, whole: "1,234 tok/s"; "–" without two readings."""
    return "–" if per_second is None else f"{per_second:,.0f} tok/s"
