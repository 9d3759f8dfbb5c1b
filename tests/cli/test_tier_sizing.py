"""`kvctl pool resize --tier host|disk` before it asks: the plan is in whole pages of the tier
(a size rounded down, as the agent rounds it) and its line says what happens to the pages the
tier holds, so the confirmation shows what will really happen."""

from __future__ import annotations

import pytest
from pool_readings import pool_snapshot, tier_reading

from kvctl.api import TierReading
from kvctl.cli.pool import plan_tier_resize
from kvctl.view import render

PAGE = 64 << 10


def tier(name: str = "host", **fields) -> TierReading:
    """The shared idle tier of 1,024 pages of 64 KiB, 256 of them held."""
    return tier_reading(name, **{"page_bytes": PAGE, "used_pages": 256, **fields})


def tiered(tiers: list[TierReading]):
    return pool_snapshot(tiers=tiers)


def test_a_tier_resize_says_what_happens_to_the_pages_it_holds() -> None:
    host = tier()  # 256 of 1,024 pages held
    disk = tier("disk", page_bytes=PAGE + 48, filesystem_free_bytes=1 << 30)
    pool = tiered(tiers=[host, disk])
    off = render.tier_resize_plan("http://n1", pool, host, plan_tier_resize(host, pages=0))
    assert off == (
        "http://n1 host tier: 1,024 pages (64 MiB) → 0 pages (0 B); turns the tier off; "
        "256 of the 256 pages it holds go to the disk tier"
    )
    shrink = plan_tier_resize(host, shrink="960")
    assert "; 192 of the 256 pages it holds go to the disk tier" in render.tier_resize_plan(
        "a", pool, host, shrink
    )
    dropped = render.tier_resize_plan("a", pool, disk, plan_tier_resize(disk, pages=56))
    assert dropped.endswith("; 200 of the 256 pages it holds are dropped")
    big = render.tier_resize_plan("a", pool, disk, plan_tier_resize(disk, size="2GiB"))
    assert big.endswith("; more than the 1 GiB free on its filesystem")
    same = plan_tier_resize(host, size="64MiB")
    assert render.tier_resize_plan("a", pool, host, same).endswith("; nothing changes")


def test_tier_sizes_round_down_to_whole_pages_as_the_agent_does() -> None:
    disk = tier("disk", page_bytes=PAGE + 48)
    plan = plan_tier_resize(disk, size="1MiB")
    assert (plan.new_pages, plan.request.pages, plan.request.tier) == (15, 15, "disk")
    assert plan_tier_resize(disk, grow="1MiB").new_pages == 1024 + 16  # a grow rounds up
    with pytest.raises(ValueError, match="less than one page of the disk tier"):
        plan_tier_resize(disk, size="1KiB")
    assert plan_tier_resize(disk, size="0").new_pages == 0
