"""The heat strip: exact page counts per cell, segment marks, and what each glyph means."""

from __future__ import annotations

from rich.console import Console

from kvctl.api import PoolMap
from kvctl.view.poolmap import Cell, cells, grid, segment_marks, strip


def page_map(runs, capacity: int = 16, segment: int = 8) -> PoolMap:
    return PoolMap(capacity_pages=capacity, segment_pages=segment, runs=runs)


def test_cells_count_pages_of_each_state_exactly() -> None:
    # pages: UUU CC FFFFF UU FFFF  (16) -> 4 cells of 4 pages
    layout = page_map(
        [("used", 0, 3), ("cached", 3, 2), ("free", 5, 5), ("used", 10, 2), ("free", 12, 4)]
    )
    assert cells(layout, 4) == [
        Cell(used=3, cached=1),
        Cell(cached=1, free=3),
        Cell(used=2, free=2),
        Cell(free=4),
    ]


def test_cells_never_outnumber_pages() -> None:
    layout = page_map([("used", 0, 2), ("free", 2, 2)], capacity=4, segment=2)
    assert cells(layout, 80) == [Cell(used=1), Cell(used=1), Cell(free=1), Cell(free=1)]


def test_uneven_slices_cover_every_page_once() -> None:
    layout = page_map([("used", 0, 7), ("free", 7, 3)], capacity=10)
    counted = cells(layout, 3)
    assert sum(cell.total for cell in counted) == 10
    assert sum(cell.used for cell in counted) == 7


def test_segment_marks() -> None:
    assert segment_marks(page_map([("free", 0, 16)], segment=4), 8) == [
        True, False, True, False, True, False, True, False,
    ]  # fmt: skip


def test_glyph_height_is_fill_and_colour_is_dominant_state() -> None:
    layout = page_map([("used", 0, 4), ("cached", 4, 2), ("free", 6, 10)])
    heat = strip(layout, 4)
    assert heat.plain == "█▒··"
    assert [span.style for span in heat.spans] == [
        "magenta",
        "cyan",
        "bright_black",
        "bright_black",
    ]


def test_grid_rows_start_with_their_first_page() -> None:
    layout = page_map([("used", 0, 100), ("free", 100, 156)], capacity=256, segment=32)
    console = Console(width=100)
    console.begin_capture()
    console.print(grid(layout, 40, 2))
    lines = console.end_capture().splitlines()
    assert lines[0].startswith("  0 ███")
    assert lines[2].startswith("128 ···")
    assert lines[-1].startswith("█ used 100   ▓ cached 0   · free 156")


def test_the_strip_and_its_legend_read_without_colour() -> None:
    """The legend's three ■ differed only by colour, and so did a cell mostly in use from one
    mostly cached: with NO_COLOR both were unreadable."""
    layout = page_map([("used", 0, 4), ("cached", 4, 4), ("free", 8, 8)], capacity=16)
    console = Console(width=100, no_color=True)
    console.begin_capture()
    console.print(grid(layout, 7, 1))  # 4 cells after the row label
    heat, _, legend = console.end_capture().splitlines()
    assert heat.split()[-1] == "█▓··"
    assert legend.startswith("█ used 4   ▓ cached 4   · free 8")
