"""Resize targets: every way of naming a size becomes the request and the sizes to confirm."""

from __future__ import annotations

import pytest
from pool_readings import pool_snapshot

from kvctl.api import PoolSnapshot, ResizeRequest
from kvctl.sizing import amount_in_pages, plan_from_text, plan_resize

PAGE = 64 << 10  # bytes per page of the small test pool


def pool(capacity: int = 256, segment: int = 32) -> PoolSnapshot:
    """A pool of `capacity` pages of 64 KiB in segments of `segment` pages, nothing used."""
    return pool_snapshot(
        capacity_pages=capacity,
        segment_pages=segment,
        bytes_per_page=PAGE,
        used_pages=0,
        cached_pages=0,
        free_extents=1,
        fragmentation=0.0,
    )


def test_amount_is_pages_without_a_unit_and_bytes_with_one() -> None:
    assert amount_in_pages("64", PAGE) == 64
    assert amount_in_pages("64 pages", PAGE) == 64
    assert amount_in_pages("1MiB", PAGE) == 16
    assert amount_in_pages("100KiB", PAGE) == 2  # rounded up to whole pages


@pytest.mark.parametrize(
    ("spec", "request_", "new_pages"),
    [
        ({"pages": 100}, ResizeRequest(pages=100), 128),  # rounded up to whole segments
        ({"size": "8MiB"}, ResizeRequest(bytes=8 << 20), 128),
        ({"grow": "32"}, ResizeRequest(pages=288), 288),
        ({"grow": "1MiB"}, ResizeRequest(pages=272), 288),
        ({"shrink": "64"}, ResizeRequest(pages=192), 192),
        ({"shrink": "2MiB"}, ResizeRequest(pages=224), 224),
    ],
)
def test_plan_from_current_capacity(spec, request_, new_pages) -> None:
    plan = plan_resize(pool(), **spec)
    assert plan.request == request_
    assert (plan.old_pages, plan.new_pages) == (256, new_pages)
    assert plan.new_bytes == new_pages * PAGE


def test_plan_direction() -> None:
    assert plan_resize(pool(), grow="1").direction == "grow"
    assert plan_resize(pool(), shrink="32").direction == "shrink"
    assert plan_resize(pool(), pages=256).direction == "none"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "exactly one"),
        ({"pages": 1, "grow": "1"}, "exactly one"),
        ({"pages": 0}, "at least 1 page"),
        ({"shrink": "256"}, "only 256 pages"),
        ({"size": "8 parsecs"}, "8GiB"),
        ({"grow": "lots"}, "8GiB"),
    ],
)
def test_plan_refuses_with_what_to_do(spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        plan_resize(pool(), **spec)


@pytest.mark.parametrize(
    ("text", "request_"),
    [
        ("320", ResizeRequest(pages=320)),
        ("8MiB", ResizeRequest(bytes=8 << 20)),
        ("+32", ResizeRequest(pages=288)),
        ("+1MiB", ResizeRequest(pages=272)),
        ("-64", ResizeRequest(pages=192)),
    ],
)
def test_dialog_text(text, request_) -> None:
    assert plan_from_text(pool(), text).request == request_


def test_dialog_text_empty_says_what_to_type() -> None:
    with pytest.raises(ValueError, match=r"\+1GiB"):
        plan_from_text(pool(), "  ")


def test_the_allocation_headline_keeps_window_and_lifetime_counts_apart() -> None:
    from rich.console import Console

    from kvctl.view.render import headline_table

    snapshot = pool().model_copy(
        update=dict(
            alloc_success_ratio=0.9,
            window_alloc_attempts=40,
            window_alloc_failures=4,
            alloc_attempts_total=3697,
            alloc_failures_total=37,
        )
    )
    console = Console(width=200, record=True)
    console.print(headline_table(snapshot))
    text = console.export_text()
    assert "40 attempts, 4 failed in the last 5m00s (37 failed of 3,697 since start)" in text
