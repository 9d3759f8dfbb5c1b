"""The budget views without an agent: the bar's split, its legend's shorter forms, a pool's
share rows, and the tables with a row per pool (the CLI's fleet table at 80 and 160 columns).
"""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pool_readings import pool_snapshot
from rich.console import Console

from kvctl.api import Alert, PoolShare
from kvctl.fleet import Reading
from kvctl.view import budget
from kvctl.view.render import FleetTable, alerts_table, pool_table, pools_table, resize_result

MiB = 1 << 20


def share(**fields) -> PoolShare:
    base = dict(
        budget_bytes=64 * MiB,
        assigned_bytes=48 * MiB,
        floor_pages=64,
        ceiling_pages=768,
        pools_total=2,
    )
    return PoolShare(**{**base, **fields})


def pools() -> tuple:
    """`chat` 32 MiB under pressure, `code` 16 MiB pinned, 16 MiB of 64 free."""
    chat = pool_snapshot(pool="chat", share=share(under_pressure=True, short_pages=8))
    code = pool_snapshot(pool="code", capacity_pages=256, used_pages=100, share=share(pinned=True))
    return chat, code


def rendered(renderable: object, width: int = 160) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue()


@given(
    sizes=st.lists(st.integers(0, 1 << 30), min_size=1, max_size=6),
    free=st.integers(0, 1 << 30),
    width=st.integers(0, 200),
)
def test_the_split_fills_the_width_in_proportion(sizes: list[int], free: int, width: int) -> None:
    total = sum(sizes) + free
    cells = budget.split(sizes, total, width)
    assert len(cells) == len(sizes) + 1
    if total == 0:
        return
    assert sum(cells) == width
    parts = [*sizes, free]
    for part, count in zip(parts, cells, strict=True):
        assert abs(count - part * width / total) < 1 + (len(parts) if part else 0)
        if part and width >= 2 * len(parts):
            assert count >= 1  # a pool with any memory is never invisible


def test_the_bar_has_a_glyph_per_pool_then_what_is_free() -> None:
    chat, code = pools()
    assert budget.bar((chat, code), 64 * MiB, 16).plain == "█" * 8 + "▓" * 4 + "░" * 4


@pytest.mark.parametrize(
    ("form", "text"),
    [
        (0, "█ chat 32 MiB under pressure  ▓ code 16 MiB pinned  ░ 16 MiB free"),
        (1, "█ chat 32 MiB pressure  ▓ code 16 MiB pinned  ░ 16 MiB"),
        (2, "█ chat pressure  ▓ code pinned  ░ 16 MiB"),
        (3, "█ chat  ▓ code  ░"),
    ],
)
def test_the_legend_gives_way_in_order(form: int, text: str) -> None:
    assert budget.legend(pools(), 64 * MiB, form=form).plain == text


def test_a_pools_share_rows() -> None:
    chat, code = pools()
    text = rendered(pool_table(code))
    assert "share       16 MiB of the 64 MiB budget (25.0 %); floor 64 pages, ceiling 768" in text
    assert "pinned      yes: the agent moves no memory in or out of it; kvctl pool release " in text
    assert "--pool code hands it back" in text
    assert "rebalances  none yet" in text
    assert "pressure    under pressure, 8 pages short; 0 pages reclaimable" in rendered(
        pool_table(chat)
    )
    assert "share" not in rendered(pool_table(pool_snapshot()))  # no budget: as before


def test_rebalances_with_their_bytes() -> None:
    moved = pool_snapshot(
        share=share(
            rebalances_total={"in": 3, "out": 1},
            rebalanced_bytes_total={"in": 12 * MiB, "out": 4 * MiB},
        )
    )
    assert budget.rebalances(moved) == "3 in (+12 MiB), 1 out (−4 MiB)"


def test_the_pools_table_has_a_row_per_pool() -> None:
    lines = rendered(pools_table(pools(), 64 * MiB)).splitlines()
    assert lines[0].split()[:3] == ["pool", "capacity", "of"]
    assert lines[1].split()[:6] == ["chat", "512", "pages", "(32", "MiB)", "50.0"]
    assert lines[1].rstrip().endswith("under pressure; 0 in, 0 out")
    assert lines[2].rstrip().endswith("pinned; 0 in, 0 out")


def test_a_resize_that_pins_says_how_to_release() -> None:
    from kvctl.api import ResizeResult

    result = ResizeResult(
        old_pages=64, new_pages=48, old_bytes=4 * MiB, new_bytes=3 * MiB, direction="shrink",
        pages_moved=0, pages_evicted=0, pinned=True,
    )  # fmt: skip
    text = rendered(resize_result(result, "small"))
    assert "pool    small" in text
    assert "pinned  now pinned: the agent moves no memory in or out of this pool until kvctl " in (
        text
    )
    assert "pool release --pool small hands it back" in text


def fleet() -> list[Reading]:
    chat, code = pools()
    alerts = tuple(
        Alert(
            name=name,
            severity="warning",
            state="firing",
            value=1.0,
            summary="",
            description="",
            remediation="",
            runbook_url="",
            active_since=0.0,
            labels={"pool": pool},
        )
        for name, pool in (("KvctlPoolNearlyFull", "chat"), ("KvctlPreemptionStorm", "code"))
    )
    return [
        Reading(agent="http://node1:8477", pool=pool_snapshot()),
        Reading(
            agent="http://node2:8477",
            pool=chat,
            pools=(chat, code),
            alerts=alerts,
            budget_bytes=64 * MiB,
        ),
    ]


@pytest.mark.parametrize("width", [80, 160])
def test_the_fleet_table_has_a_row_per_agent_and_pool_with_its_alerts(width: int) -> None:
    lines = rendered(FleetTable(fleet()), width).splitlines()
    assert lines[0].split()[:3] == ["agent", "state", "pool"]
    rows = [line.split() for line in lines[1:]]
    assert [row[2] for row in rows] == ["demo", "chat", "code"]
    for row, name in zip(rows[1:], ("KvctlPoolNearlyFull", "KvctlPreemptionStorm"), strict=True):
        assert row[-1] == name or (row[-1].endswith("…") and name.startswith(row[-1][:-1]))
    assert all(len(line) <= width for line in lines)


def test_a_fleet_of_single_pools_keeps_its_narrow_table() -> None:
    lines = rendered(FleetTable(fleet()[:1]), 80).splitlines()
    assert "pool" not in lines[0].split()


def test_alerts_of_several_pools_say_which() -> None:
    text = rendered(alerts_table(fleet()[1].alerts, now=60.0))
    assert text.splitlines()[0].split()[:4] == ["severity", "┃", "state", "┃"]
    assert "┃ pool " in text.splitlines()[0]
    assert "pool" not in rendered(alerts_table(fleet()[1].alerts[:1], now=60.0)).splitlines()[0]


def test_sizing_advice_names_the_pool_and_its_ceiling() -> None:
    from kvctl.view.render import sizing_table

    chat, _ = pools()
    text = " ".join(rendered(sizing_table(chat, 32_768, 8)).split())
    assert "kvctl pool resize --pages 16384 --pool chat" in text
    assert "(above its ceiling of 768 in the 64 MiB budget: restart with a larger --kv-budget)" in (
        text
    )
