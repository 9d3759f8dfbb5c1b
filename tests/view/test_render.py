"""The CLI's tables at 80 columns: an alert name is whole, or visibly cut with an ellipsis when
the terminal is too narrow for the row; never folded onto two lines, where it reads as two names
and cannot be searched for in the runbook or in Alertmanager."""

from __future__ import annotations

import io

from pool_readings import pool_snapshot
from rich.console import Console

from kvctl.api import Alert
from kvctl.client import AgentUnreachable
from kvctl.fleet import Reading
from kvctl.view.render import FleetTable, alerts_table, headline_table, sizing_table

NAMES = ("KvctlAllocationFailures", "KvctlGpuMemoryNearCapacity", "KvctlPreemptionStorm")


def alert(name: str) -> Alert:
    return Alert(
        name=name,
        severity="warning",
        state="firing",
        value=0.5,
        summary=f"{name} says what is wrong in a sentence long enough to wrap at 80 columns",
        description="",
        remediation="kvctl --agent http://gpu-node-17.example.com:8477 pool resize --pages 640",
        runbook_url="http://gpu-node-17.example.com:8477/runbook",
        active_since=0.0,
    )


def rendered(renderable: object, width: int = 80) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue()


def test_alert_names_are_whole_in_the_alerts_table() -> None:
    text = rendered(alerts_table([alert(n) for n in NAMES], now=60.0))
    for name in NAMES:
        assert name in text, text
    assert max(len(line) for line in text.splitlines()) <= 80


def fleet(width: int) -> list[str]:
    reading = Reading(
        agent="http://gpu-node-17.example.com:8477",
        pool=pool_snapshot(),
        alerts=tuple(alert(n) for n in NAMES),
    )
    return rendered(FleetTable([reading]), width).splitlines()


def test_alert_names_in_the_fleet_table_are_one_a_line_and_whole_when_there_is_room() -> None:
    lines = fleet(160)
    for name in NAMES:
        assert sum(line.rstrip().endswith(name) for line in lines) == 1, "\n".join(lines)


def test_at_80_columns_a_name_is_cut_with_an_ellipsis_not_folded_and_the_numbers_stay() -> None:
    lines = fleet(80)
    for number in ("50.0 %", "0.05", "100.00 %", "60.0 %", "4/0"):
        assert number in lines[1], "\n".join(lines)
    cells = [line[lines[0].index("alerts") :].strip() for line in lines[1:]]
    assert len(cells) == len(NAMES), "\n".join(lines)  # one line per name, no more
    for cell, name in zip(cells, NAMES, strict=True):
        assert cell == name or (cell.endswith("…") and name.startswith(cell[:-1])), cell


def test_pending_alerts_are_named_after_the_firing_ones() -> None:
    pending = alert("KvctlPoolOverProvisioned").model_copy(update={"state": "pending"})
    reading = Reading(
        agent="http://node1:8477", pool=pool_snapshot(), alerts=(pending, alert(NAMES[0]))
    )
    lines = rendered(FleetTable([reading]), 160).splitlines()
    assert lines[1].rstrip().endswith(NAMES[0])
    assert lines[2].rstrip().endswith("KvctlPoolOverProvisioned (pending)")


def test_the_columns_stay_put_when_an_alert_appears() -> None:
    """At 120 columns (`kvctl top --headless` without a terminal) the agent's URL used to be cut
    ("http://127.0.0.1:8…") and the columns moved in the frame where an alert appeared."""
    url = "http://127.0.0.1:8477"
    calm = rendered(FleetTable([Reading(agent=url, pool=pool_snapshot())]), 120).splitlines()
    loud = Reading(agent=url, pool=pool_snapshot(), alerts=(alert("KvctlPreemptionStorm"),))
    alerted = rendered(FleetTable([loud]), 120).splitlines()
    assert calm[0] == alerted[0]  # the header, so every column, where it was
    assert alerted[1].startswith(url + " ")
    assert alerted[1][alerted[0].index("alerts") :].startswith("KvctlPreemption")


def test_a_down_agents_reason_is_folded_whole_not_cut() -> None:
    reason = (
        "cannot reach agent at http://gpu-node-17.example.com:8477 (connection refused by the "
        "host after three tries)"
    )
    down = Reading(agent="http://gpu-node-17.example.com:8477", error=AgentUnreachable("x", reason))
    up = Reading(agent="http://node1:8477", pool=pool_snapshot())
    for width in (80, 120):
        lines = rendered(FleetTable([up, down]), width).splitlines()
        start = lines[0].index("alerts")
        assert "…" not in "".join(line[start:] for line in lines[2:]), "\n".join(lines)
        folded = "".join("".join(line[start:].split()) for line in lines[2:])
        assert folded == "".join(reason.split()), "\n".join(lines)
        assert max(len(line) for line in lines) <= width


def test_one_free_extent_is_singular() -> None:
    """The status detail read "1 free extents"."""
    pool = pool_snapshot(free_extents=1, largest_free_run=1)
    text = " ".join(rendered(headline_table(pool), 120).split())
    assert "1 free extent, largest free run 1 page" in text
    many = " ".join(rendered(headline_table(pool_snapshot(free_extents=1200)), 120).split())
    assert "1,200 free extents" in many


def test_a_pool_that_holds_one_full_context_says_request() -> None:
    pool = pool_snapshot(capacity_pages=256, page_size=16)
    text = " ".join(rendered(sizing_table(pool, 4096), 120).split())
    assert "1 request of the full 4,096-token context" in text


def test_a_sleeping_pool_says_what_it_released_and_what_wakes_it() -> None:
    from kvctl.api import SleepReading
    from kvctl.view.render import pool_table

    awake = rendered(pool_table(pool_snapshot()), width=160)
    assert "sleep" not in awake and "asleep" not in awake
    asleep = pool_snapshot().model_copy(
        update={
            "capacity_pages": 0,
            "sleep": SleepReading(
                state="asleep", level=2, asleep_seconds=95.0, released_bytes=8 * 2**20
            ),
        }
    )
    text = " ".join(rendered(pool_table(asleep), width=160).split())
    assert "asleep at level 2 for 1m35s: 8 MiB released, its weights dropped" in text, text
    assert "wake --model" in text


def test_a_sleeping_pool_reads_asleep_in_the_fleet_table_without_made_up_ratios() -> None:
    from kvctl.api import SleepReading

    asleep = pool_snapshot(capacity_pages=0, used_pages=0, cached_pages=0).model_copy(
        update={"sleep": SleepReading(state="asleep", level=1, asleep_seconds=5.0)}
    )
    reading = Reading(agent="http://gpu-node-17.example.com:8477", pool=asleep)
    [_, row] = rendered(FleetTable([reading]), 160).splitlines()
    assert " sleep " in row and " up " not in row, row
    cells = row.split()
    assert "0.00" not in cells and "0.0 %" not in cells, row  # no fragmentation, no utilisation
