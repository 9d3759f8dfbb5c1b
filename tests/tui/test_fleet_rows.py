"""The fleet table's rows without a terminal: sorting, filtering, fitting cells to a width."""

from __future__ import annotations

import pytest

from kvctl.tui.fleet_rows import (
    BY_KEY,
    COLUMNS,
    Sort,
    alerts_text,
    cells,
    columns,
    header,
    key_of,
    matches,
    sort_rows,
    widths,
)

A, B, C, D = (f"http://node{i}:8477" for i in range(1, 5))


@pytest.fixture
def fleet(fakes) -> list:
    """Four agents: fragmentation 0.78, 0.00, 0.50 and one down."""
    return [
        fakes.reading(A),
        fakes.reading(B, largest_free_run=23, alerts=()),
        fakes.reading(C, free_pages=20, used_pages=153, largest_free_run=10, alerts=()),
        fakes.down(D),
    ]


def agents(readings) -> list[str]:
    return [reading.agent for reading in readings]


def test_first_sort_puts_the_worst_first_and_down_agents_last(fleet) -> None:
    by_frag = Sort().on("frag")
    assert by_frag.descending  # high fragmentation is the worst
    assert agents(sort_rows(fleet, by_frag)) == [A, C, B, D]
    assert agents(sort_rows(fleet, by_frag.reversed())) == [B, C, A, D]  # still last
    by_success = Sort().on("alloc")
    assert not by_success.descending  # low allocation success is the worst


def test_state_sort_puts_down_agents_first(fleet) -> None:
    assert agents(sort_rows(fleet, Sort().on("state")))[0] == D


def test_ties_keep_the_order_given(fleet) -> None:
    assert agents(sort_rows(fleet, Sort().on("run"))) == [A, B, C, D]  # all run 7; D has none
    assert agents(sort_rows(fleet, Sort())) == [A, B, C, D]
    assert agents(sort_rows(fleet, Sort().reversed())) == [D, C, B, A]


def test_s_cycles_every_column_then_the_order_given() -> None:
    sort, seen = Sort(), []
    for _ in COLUMNS:
        sort = sort.next_column()
        seen.append(sort.key)
    assert seen == [column.key for column in COLUMNS]
    assert sort.next_column() == Sort()


def test_a_header_click_sorts_and_a_second_reverses() -> None:
    once = Sort().on("util")
    assert once == Sort("util", True)
    assert once.on("util") == Sort("util", False)
    assert once.on("agent") == Sort("agent", False)


def test_sort_is_described_in_words() -> None:
    assert Sort().describe() == "in the order given"
    assert Sort().on("frag").describe() == "sorted by frag, worst first"
    assert Sort().on("frag").reversed().describe() == "sorted by frag, best first"
    assert Sort().on("agent").reversed().describe() == "sorted by agent, Z to A"


def test_filter_matches_url_and_alert_names_in_any_case(fleet) -> None:
    assert [r.agent for r in fleet if matches(r, "NODE3")] == [C]
    assert [r.agent for r in fleet if matches(r, "fragmentationhigh")] == [A]
    assert [r.agent for r in fleet if matches(r, "prefixhit")] == [A]  # pending ones too
    assert all(matches(r, "  ") for r in fleet)
    assert not any(matches(r, "KvctlQueueStalled") for r in fleet)


def test_alert_names_are_whole_or_cut_with_an_ellipsis(fakes) -> None:
    names = ("KvctlPoolNearlyFull", "KvctlAllocationFailures", "KvctlPreemptionStorm")
    reading = fakes.reading(alerts=[fakes.alert(name) for name in names])
    roomy = alerts_text(reading, 80).plain
    assert roomy == "KvctlAllocationFailures, KvctlPoolNearlyFull, KvctlPreemptionStorm"
    assert alerts_text(reading, 30).plain == "KvctlAllocationFailures +2"
    assert alerts_text(reading, 50).plain == "KvctlAllocationFailures, KvctlPoolNearlyFull +1"
    assert alerts_text(reading, 15).plain == "KvctlAlloca… +2"


def test_critical_alerts_come_first(fakes) -> None:
    reading = fakes.reading(
        alerts=[fakes.alert("KvctlAaa"), fakes.alert("KvctlZzz", severity="critical")]
    )
    assert alerts_text(reading, 40).plain == "KvctlZzz, KvctlAaa"


def test_down_agents_show_why_and_quiet_ones_say_so(fakes, fleet) -> None:
    assert alerts_text(fleet[3], 40).plain == "connection refused"
    assert alerts_text(fleet[1], 40).plain == "none"
    pending = fakes.reading(alerts=[fakes.alert("KvctlX", state="pending")])
    assert alerts_text(pending, 40).plain == "1 pending"


@pytest.mark.parametrize("total", [79, 159])
def test_columns_fill_the_width_exactly(fleet, total: int) -> None:
    fitted = widths(total, agents(fleet))
    shown = columns(False, total)
    assert ("preempt" in fitted) == (total >= 100)  # at 80 the agent's name keeps its room
    assert sum(fitted.values()) + len(shown) == total
    assert fitted["agent"] == len("node1:8477")  # http:// is left out
    for reading in fleet:
        row = cells(reading, fitted)
        assert [len(cell) for cell in row] == [fitted[c.key] + 1 for c in shown]


def test_long_agent_names_leave_room_for_alerts() -> None:
    fitted = widths(79, ["http://" + "gpu-node-17.cluster.example.com:8477"])
    assert fitted["agent"] < fitted["alerts"]


def test_a_down_row_has_dashes_not_numbers(fleet) -> None:
    fitted = widths(159, agents(fleet))
    row = [cell.plain.strip() for cell in cells(fleet[3], fitted)]
    assert row == ["node4:8477", "down", *["–"] * 7, "connection refused"]


def test_the_sorted_column_carries_an_arrow() -> None:
    util, frag, agent = BY_KEY["util"], BY_KEY["frag"], BY_KEY["agent"]
    assert header(util, 7, Sort()).plain == "    util"
    assert header(util, 7, Sort().on("util")).plain == "   ▼util"
    assert header(agent, 8, Sort().on("agent")).plain == " agent▲  "
    assert header(frag, 4, Sort().on("frag")).plain == "▼frag"  # no room: in the gap


# ---- several pools ----------------------------------------------------------------------------


@pytest.fixture
def pooled(fakes) -> list:
    """node1 with one pool, node2 serving `chat` and `code`, one row each."""
    return [fakes.reading(A), *fakes.pools_reading(B).per_pool()]


def test_rows_of_several_pools_have_a_pool_column_and_their_own_keys(pooled) -> None:
    assert [c.key for c in columns(True)][:3] == ["agent", "pool", "state"]
    assert columns(False) == COLUMNS
    fitted = widths(99, agents(pooled), ["chat", "code"])
    assert fitted["pool"] == 4 and sum(fitted.values()) + len(columns(True, 99)) == 99
    rows = [[cell.plain.strip() for cell in cells(r, fitted)] for r in pooled]
    assert [row[:3] for row in rows] == [
        ["node1:8477", "demo", "up"],
        ["node2:8477", "chat", "up"],
        ["node2:8477", "code", "up"],
    ]
    assert rows[1][-1] == "KvctlFragmentationHigh" and rows[2][-1] == "1 pending"
    assert [key_of(r) for r in pooled] == [A, f"{B}#chat", f"{B}#code"]


def test_the_filter_and_the_sort_know_the_pool(pooled) -> None:
    assert [key_of(r) for r in pooled if matches(r, "COD")] == [f"{B}#code"]
    by_pool = Sort().on("pool")
    assert [key_of(r) for r in sort_rows(pooled, by_pool)] == [f"{B}#chat", f"{B}#code", A]
    assert by_pool.describe() == "sorted by pool, A to Z"
    shown, sort, seen = columns(True), Sort(), []
    for _ in shown:
        sort = sort.next_column(shown)
        seen.append(sort.key)
    assert seen == [c.key for c in shown] and sort.next_column(shown) == Sort()
