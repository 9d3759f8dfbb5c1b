"""KvctlKvBudgetExhausted: a pool of a shared KV budget under pressure that nothing can give
memory to. It fires after its `for`, resolves once a donor or room appears or the pressure
ends, never exists for a pool that shares no budget, and each likely cause names its fix: a
larger `--kv-budget`, a model moved elsewhere, a higher ceiling or a released pin."""

from __future__ import annotations

from typing import Any

import pytest
from pool_readings import pool_snapshot

from kvctl import api
from kvctl.alerts import AlertEvaluator, PoolAlerts, text

T0 = 1_700_000_000.0
AGENT = "http://node-1:8477"
NAME = "KvctlKvBudgetExhausted"
MIB = 1 << 20
BIG = dict(
    pool="big",
    bytes_per_page=128 * 1024,
    segment_pages=16,
    capacity_pages=64,
    used_pages=60,
    cached_pages=0,
    requests_running=3,
    requests_waiting=4,
)
"""A pool of 64 pages of 128 KiB (8 MiB, segments of 2 MiB) with requests waiting."""


def share(**fields: Any) -> api.PoolShare:
    """Both pools of a 12 MiB budget under pressure, all of it assigned, no donor; `fields`
    changed."""
    merged: dict[str, Any] = dict(
        budget_bytes=12 * MIB,
        assigned_bytes=12 * MIB,
        floor_pages=16,
        ceiling_pages=96,
        under_pressure=True,
        short_pages=40,
        pools_total=2,
        pools_under_pressure=2,
        donors=0,
    )
    merged.update(fields)
    return api.PoolShare(**merged)


def exhausted(pool: dict[str, Any] = BIG, **fields: Any) -> api.PoolSnapshot:
    return pool_snapshot(**{**pool, "share": share(**fields)})


class Timeline:
    """An evaluator of pool `big` fed snapshots `step` seconds apart."""

    def __init__(self, **settings: Any) -> None:
        self.now = T0
        runtime = settings.pop("runtime", None)
        alerts = api.AlertSettings(**{"for_s": 0, **settings})
        self.evaluator = AlertEvaluator(runtime or alerts, "big", "node-1:8477", lambda: self.now)

    def state(self, snapshot: api.PoolSnapshot, step: float = 60.0) -> str | None:
        """The alert's state after this snapshot (None when not active)."""
        alerts = {a.name: a for a in self.evaluator.evaluate(snapshot)}
        self.now += step
        alert = alerts.get(NAME)
        return alert.state if alert else None

    def alert(self, snapshot: api.PoolSnapshot) -> api.Alert:
        [alert] = [a for a in self.evaluator.evaluate(snapshot) if a.name == NAME]
        return alert


def test_pending_for_five_times_alert_for_then_firing() -> None:
    t = Timeline(for_s=60)
    states = [t.state(exhausted()) for _ in range(7)]
    assert states == ["pending"] * 5 + ["firing"] * 2  # 5 min of the condition, then firing
    alert = t.alert(exhausted())
    assert (alert.severity, alert.value) == ("warning", 0.0)
    assert alert.labels["pool"] == "big"
    assert alert.summary == "The KV budget at node-1:8477 has no memory left for pool big"
    assert alert.runbook_url == f"{AGENT}/runbook#kvctlkvbudgetexhausted"


def test_a_moment_without_pressure_starts_the_for_again() -> None:
    t = Timeline(for_s=60)
    assert t.state(exhausted()) == "pending"
    assert t.state(exhausted(under_pressure=False, short_pages=0)) is None
    assert t.state(exhausted()) == "pending"


def test_a_donor_resolves_it() -> None:
    t = Timeline()
    assert t.state(exhausted()) == "firing"
    assert t.state(exhausted(donors=1)) is None  # the rebalancer can feed the pool now


def test_room_for_a_segment_resolves_it() -> None:
    t = Timeline()
    assert t.state(exhausted(assigned_bytes=11 * MIB)) == "firing"  # half a 2 MiB segment
    assert t.state(exhausted(assigned_bytes=10 * MIB)) is None  # one segment: it can grow


def test_the_end_of_the_pressure_resolves_it() -> None:
    t = Timeline()
    assert t.state(exhausted()) == "firing"
    calm = exhausted(under_pressure=False, short_pages=0, pools_under_pressure=1)
    assert t.state(calm) is None


def test_a_pool_without_a_budget_never_has_it() -> None:
    """One model: no share, however full the pool and long the queue."""
    t = Timeline()
    full = pool_snapshot(**{**BIG, "used_pages": 64, "requests_waiting": 40})
    assert full.share is None
    assert t.state(full) is None


def test_zero_room_segments_turns_it_off() -> None:
    t = Timeline()
    assert t.state(exhausted()) == "firing"
    t.evaluator.settings = api.AlertSettings(for_s=0, budget_room_segments_min=0)
    assert t.state(exhausted()) is None


def test_each_pool_of_the_budget_raises_its_own() -> None:
    small = dict(BIG, pool="small", bytes_per_page=64 * 1024)
    pools = PoolAlerts(
        [AlertEvaluator(api.AlertSettings(for_s=0), n, "node-1:8477") for n in ("small", "big")]
    )
    alerts = pools.evaluate([exhausted(small, short_pages=8), exhausted()])
    mine = {a.labels["pool"]: a for a in alerts if a.name == NAME}
    assert set(mine) == {"small", "big"}
    assert "`--kv-budget 13MiB` (1.0 MiB more: 16 pages of `small`)" in mine["small"].remediation
    assert "`--kv-budget 18MiB` (6.0 MiB more: 48 pages of `big`)" in mine["big"].remediation


HEADLINE = (
    "the KV budget of 12.0 MiB has 0 B unassigned (0.00 of this pool's 2.0 MiB segments) and "
    "none of its 2 pools can give memory"
)
BUDGET = "`--kv-budget 18MiB` (6.0 MiB more: 48 pages of `big`)"


def test_every_pool_under_pressure_asks_for_a_larger_budget_or_a_model_moved() -> None:
    alert = Timeline().alert(exhausted())
    assert alert.description == (
        f"{HEADLINE}; its waiting requests are short of 40 pages, and both pools of the budget "
        "are under pressure: the models' load needs more KV memory than the budget holds"
    )
    assert alert.remediation == (
        f"Restart the agent with {BUDGET}, or move a model to another agent (restart this one "
        "without its `--model`): `big` holds 8.0 MiB (66.67%) of the budget, the most of any pool"
    )


def test_a_pool_pressed_by_preemptions_asks_for_one_segment() -> None:
    small = dict(BIG, capacity_pages=32)  # 4 MiB of the 12: not the largest
    alert = Timeline().alert(exhausted(small, short_pages=0, pools_total=3, pools_under_pressure=3))
    assert alert.description.split("; ", 1)[1] == (
        "its requests are preempted or fail to allocate, and all 3 pools of the budget are under "
        "pressure: the models' load needs more KV memory than the budget holds"
    )
    assert alert.remediation == (
        "Restart the agent with `--kv-budget 14MiB` (2.0 MiB more: 16 pages of `big`), or move "
        "a model to another agent (restart this one without its `--model`): `big` holds 4.0 MiB "
        "(33.33%) of the budget"
    )


def test_a_pool_at_its_ceiling_needs_a_higher_one_and_the_budget_for_it() -> None:
    alert = Timeline().alert(exhausted(ceiling_pages=64))
    assert alert.description.split("; ", 1)[1] == (
        "its waiting requests are short of 40 pages, but the pool is at its ceiling of 64 pages: "
        "it may not grow even when memory frees up"
    )
    assert alert.remediation == (
        "Raise the ceiling of `big` and the budget with it: restart the agent with "
        "`max_pool_pages = 80` in its `[[models]]` entry (`--max-pool-pages` bounds every model) "
        "and `--kv-budget 14MiB` (2.0 MiB more: 16 pages of `big`)"
    )


def test_a_pinned_pool_is_released() -> None:
    alert = Timeline().alert(exhausted(pinned=True))
    assert alert.description.split("; ", 1)[1] == (
        "its waiting requests are short of 40 pages, but an operator's resize pinned the pool at "
        "64 pages: the agent moves no memory into it"
    )
    assert alert.remediation == (
        f"Release it with `kvctl --agent {AGENT} pool release --pool big` so the agent sizes it "
        f"again; for memory now, restart the agent with {BUDGET}"
    )


def test_calm_pools_that_give_nothing_are_released_or_the_budget_grows() -> None:
    runtime = api.RuntimeSettings(
        alerts=api.AlertSettings(for_s=0), rebalance=api.RebalanceSettings(calm_s=20.0)
    )
    alert = Timeline(runtime=runtime).alert(exhausted(pools_total=3, pools_under_pressure=1))
    assert alert.description.split("; ", 1)[1] == (
        "its waiting requests are short of 40 pages, while 2 of the budget's 3 pools are calm "
        "but give none: an operator's resize pinned them, they hold no whole segment beyond what "
        "they use and keep as headroom, or they have been calm for less than "
        "`rebalance.calm_s=20`"
    )
    assert alert.remediation == (
        f"Release the pools an operator pinned with `kvctl --agent {AGENT} pool release --pool "
        f"NAME` (`kvctl --agent {AGENT} pool show` shows which are), or restart the agent with "
        f"{BUDGET}"
    )


@pytest.mark.parametrize(
    ("num_bytes", "expected"),
    [
        (12 * MIB, "12MiB"),
        (12 * MIB + 1, "13MiB"),  # never less than the pages asked for
        (3840 * 1024, "3840KiB"),
        ((40 << 30) + 300 * MIB, "41GiB"),
    ],
)
def test_a_suggested_budget_is_rounded_up(num_bytes, expected) -> None:
    assert text.size_arg_up(num_bytes) == expected


def test_a_pool_alert_on_a_shared_budget_names_its_pool_in_the_command() -> None:
    """Without `--pool`, a pool command on an agent with several models is refused (409): every
    pool-scoped remediation of a pool that shares a budget carries it; a lone pool's does not."""
    nearly_full = dict(BIG, used_pages=64, requests_waiting=6, requests_running=8)
    roomy = share(donors=1, assigned_bytes=8 * MIB)
    shared = Timeline().evaluator.evaluate(pool_snapshot(**nearly_full, share=roomy))
    alone = Timeline().evaluator.evaluate(pool_snapshot(**nearly_full))
    shared_fixes = [a.remediation for a in shared if "pool resize" in a.remediation]
    alone_fixes = [a.remediation for a in alone if "pool resize" in a.remediation]
    assert shared_fixes and alone_fixes
    assert all("--pool big`" in fix for fix in shared_fixes)
    assert not any("--pool" in fix for fix in alone_fixes)


def test_a_shared_pool_grows_within_its_budget_not_past_max_pool_pages() -> None:
    """A pool of a shared budget has no `--max-pool-pages` of its own to raise: with room in the
    budget the fix is a resize (which pins it), without, a larger `--kv-budget`."""
    full = dict(BIG, used_pages=64, requests_waiting=6, requests_running=8, max_pool_pages=96)
    roomy = share(donors=1, assigned_bytes=8 * MIB)  # 4 MiB unassigned: room for 16 pages more
    tight = share(donors=0)
    [with_room] = [
        a.remediation
        for a in Timeline().evaluator.evaluate(pool_snapshot(**full, share=roomy))
        if a.name == "KvctlPoolNearlyFull"
    ]
    assert "pool resize --pages 80 --pool big`" in with_room and "pins the pool" in with_room
    assert "pool release --pool big" in with_room
    [without] = [
        a.remediation
        for a in Timeline().evaluator.evaluate(pool_snapshot(**full, share=tight))
        if a.name == "KvctlPoolNearlyFull"
    ]
    assert "larger `--kv-budget`" in without and "--max-pool-pages" not in without
    at_ceiling = dict(full, capacity_pages=96, used_pages=96, max_pool_pages=96)
    fixes = [
        a.remediation
        for a in Timeline().evaluator.evaluate(pool_snapshot(**at_ceiling, share=tight))
        if "Restart" in a.remediation and a.name != NAME
    ]
    assert fixes and all("--kv-budget" in f and "--max-pool-pages" not in f for f in fixes)
