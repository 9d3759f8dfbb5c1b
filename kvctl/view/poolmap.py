"""The pool map as a heat strip: every page's state, shrunk to the width of a terminal.

Each cell stands for an equal slice of the page ids. Its glyph grows with how full the slice is
(used + cached pages): a bar rising for a slice mostly in use, a bar filling from the left for
one mostly in sliding windows (pages a sliding-window layer group holds, which it gives back as
its window moves on), a shade darkening for one mostly cached, `·` for an empty one. So holes
between live pages, the cached prefix pages and an empty tail all stay visible at any pool size,
without colour too (NO_COLOR); the colour repeats the state. A ruler under the strip marks where
each segment (the unit the pool grows and shrinks by) begins.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Group
from rich.text import Text

if TYPE_CHECKING:
    from kvctl.api import PoolMap

GLYPHS = " ▁▂▃▄▅▆▇█"
"""A slice mostly in use, by eighths full."""
SHADES = " ░░░▒▒▒▓▓"
"""A slice mostly cached, by eighths full: never a bar, so it reads apart without colour."""
WINDOW_GLYPHS = " ▏▎▍▌▋▊▉█"
"""A slice mostly in sliding windows, by eighths full: a bar from the left, not from below."""
EMPTY = "·"
LEGEND_GLYPH = {"used": GLYPHS[-1], "window": "▌", "cached": SHADES[-1], "free": EMPTY}
STATE_STYLE = {"used": "magenta", "window": "blue", "cached": "cyan", "free": "bright_black"}
STATE_GLYPHS = {"used": GLYPHS, "window": WINDOW_GLYPHS, "cached": SHADES, "free": GLYPHS}


@dataclass
class Cell:
    """Page counts of one slice of the pool."""

    used: int = 0
    cached: int = 0
    free: int = 0
    window: int = 0  # used, by sliding-window groups

    @property
    def total(self) -> int:
        return self.used + self.window + self.cached + self.free

    @property
    def fill(self) -> float:
        return 0.0 if self.total == 0 else (self.used + self.window + self.cached) / self.total

    @property
    def state(self) -> str:
        if self.used == self.window == self.cached == 0:
            return "free"
        most = max(self.used, self.window, self.cached)
        return "used" if self.used == most else "window" if self.window == most else "cached"


def _bounds(capacity: int, width: int) -> list[int]:
    """Start page of each of `width` cells, plus the end: equal slices of [0, capacity)."""
    return [i * capacity // width for i in range(width + 1)]


def cells(pool_map: PoolMap, width: int) -> list[Cell]:
    """`pool_map` downsampled to at most `width` cells (fewer when there are fewer pages)."""
    width = max(1, min(width, pool_map.capacity_pages))
    bounds = _bounds(pool_map.capacity_pages, width)
    out = [Cell() for _ in range(width)]
    for state, start, length in pool_map.runs:
        end = start + length
        index = bisect.bisect_right(bounds, start) - 1
        while index < width and bounds[index] < end:
            overlap = min(end, bounds[index + 1]) - max(start, bounds[index])
            setattr(out[index], state, getattr(out[index], state) + overlap)
            index += 1
    return out


def segment_marks(pool_map: PoolMap, width: int) -> list[bool]:
    """Per cell, whether a segment starts inside it."""
    width = max(1, min(width, pool_map.capacity_pages))
    bounds = _bounds(pool_map.capacity_pages, width)
    step = max(1, pool_map.segment_pages)
    marks = [False] * width
    for start in range(0, pool_map.capacity_pages, step):
        marks[bisect.bisect_right(bounds, start) - 1] = True
    return marks


def strip(pool_map: PoolMap, width: int) -> Text:
    """The heat strip: one glyph per cell, height = fill, colour = dominant state."""
    text = Text()
    for cell in cells(pool_map, width):
        level = round(cell.fill * (len(GLYPHS) - 1))
        glyphs = STATE_GLYPHS[cell.state]
        text.append(glyphs[level] if level else EMPTY, style=STATE_STYLE[cell.state])
    return text


def ruler(pool_map: PoolMap, width: int) -> Text:
    """`╵` under each cell where a segment begins."""
    marks = segment_marks(pool_map, width)
    return Text("".join("╵" if mark else " " for mark in marks), style="bright_black")


def legend(pool_map: PoolMap) -> Text:
    """Page counts per state, each after the glyph of a full slice of it, coloured like the
    strip."""
    counts: dict[str, int] = {"used": 0, "window": 0, "cached": 0, "free": 0}
    for state, _start, length in pool_map.runs:
        counts[state] += length
    text = Text()
    for name, count in counts.items():
        if name == "window" and not count:
            continue  # a model whose layers all share every page has none
        text.append(f"{LEGEND_GLYPH[name]} ", style=STATE_STYLE[name])
        text.append(f"{name} {count:,}   ")
    segments = -(-pool_map.capacity_pages // max(1, pool_map.segment_pages))
    text.append(f"╵ segment start ({segments:,} × {pool_map.segment_pages:,} pages)", style="dim")
    return text


def grid(pool_map: PoolMap, width: int, rows: int) -> Group:
    """`rows` strips of `width` cells covering the pool, each led by its first page id."""
    label_width = max(len(f"{pool_map.capacity_pages:,}"), 1) + 1
    width = max(1, width - label_width)
    cells_total = min(width * rows, pool_map.capacity_pages)
    heat, marks = strip(pool_map, cells_total), ruler(pool_map, cells_total)
    lines: list[Text] = []
    for row_start in range(0, cells_total, width):
        first_page = row_start * pool_map.capacity_pages // cells_total
        label = Text(f"{first_page:>{label_width - 1},} ", style="dim")
        lines.append(label + heat[row_start : row_start + width])
        lines.append(Text(" " * label_width) + marks[row_start : row_start + width])
    lines.append(legend(pool_map))
    return Group(*lines)
