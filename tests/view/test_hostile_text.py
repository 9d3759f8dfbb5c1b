"""Hostile names from a source, through every view: printed as they read, escaped, never obeyed.

A node chooses its model and pool names, its Prometheus labels, its alerts' words and the
reasons in its errors. Each view here is fed names that are markup (`[/]` would end the command
with a MarkupError, `[bold red]owned[/]` would be styled), terminal controls (a screen clear, a
retitle, an OSC 52 clipboard write, a C1 CSI), a bidi override and a very long name, and must
print them escaped (`kvctl.view.untrusted`): no ESC, CSI, BEL or override reaches the output,
the escaped form and the brackets do, and a long name is cut.
"""

from __future__ import annotations

import io
import re

import pytest
from pool_readings import pool_snapshot, tier_reading
from rich.console import Console, RenderableType

from kvctl.api import Alert, DefragResult, GpuMemory, Health, PoolRelease, PoolShare, ResizeResult
from kvctl.client import AgentServerError
from kvctl.exposition import ModelFigures
from kvctl.figures import Figures
from kvctl.fleet import Reading
from kvctl.view import budget, engine, render, tiers
from kvctl.view.untrusted import NAME_LIMIT, clean, safe

CLIPBOARD = "\x1b]52;c;ZXZpbA==\x07"
CLEAR = "\x1b[2J"
TITLE = "\x1b]0;title\x07"
CSI = "\x9b31m"
OVERRIDE = "\u202e"
CLOSE = "[/]"
STYLED = "[bold red]owned[/]"
LONG = "m" * 5000
HOSTILE = (CLOSE, STYLED, CLIPBOARD, CLEAR, TITLE, CSI, OVERRIDE, LONG)
"""Each of them a name a node may give; every test feeds its views each of them."""
RAW = ("\x1b", "\x9b", "\x07", OVERRIDE)
"""What must never reach the terminal from a source."""


def rendered(renderable: RenderableType, width: int = 400) -> str:
    """What a terminal would be sent, without rich's own colours (so any ESC is the source's)."""
    console = Console(width=width, file=io.StringIO(), color_system=None, highlight=False)
    console.print(renderable)
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue()


def flat(text: str) -> str:
    """`text` without its whitespace, so a name folded over two lines of a cell is whole."""
    return "".join(text.split())


def assert_inert(out: str, *shown: str) -> None:
    """No control from the source in `out`, and each of `shown` in it as `clean` shows it (a
    name too long to show, cut)."""
    for raw in RAW:
        assert raw not in out, f"{raw!r} reached the output"
    assert re.search(r"(?<!\])owned", out) is None, "markup was applied"
    for name in shown:
        if len(name) > NAME_LIMIT:
            assert name[: NAME_LIMIT + 1] not in flat(out), "a long name was not cut"
        else:
            assert flat(clean(name)) in flat(out), f"{clean(name)!r} is not shown"


def hostile_alert(name: str, **labels: str) -> Alert:
    return Alert(
        name=name,
        severity="critical",
        state="firing",
        value=None,
        summary=f"summary {name}",
        description=f"description {name}",
        remediation=f"fix {name}",
        runbook_url=f"http://runbook/{name}",
        active_since=0.0,
        labels=labels,
    )


def hostile_pool(name: str, **fields: object) -> object:
    last = DefragResult(
        trigger=name, fragmentation_before=0.5, fragmentation_after=0.1, free_extents_before=4,
        free_extents_after=1, pages_moved=3, bytes_moved=3 << 16, seconds=0.01, complete=True,
    )  # fmt: skip
    return pool_snapshot(
        pool=name,
        device=name,
        gpus=[GpuMemory(index=0, name=name, used_bytes=1 << 30, total_bytes=2 << 30)],
        last_defrag=last,
        last_defrag_age_seconds=5.0,
        **fields,
    )


def agent_reading(name: str, agent: str | None = None) -> Reading:
    """One agent whose every string is `name` (its URL `agent`, else `name` too)."""
    host = tier_reading("host", policy=name)
    disk = tier_reading("disk", policy=name, path=name, store_failures_total={name: 2})
    pool = hostile_pool(name, tiers=[host, disk])
    return Reading(
        agent=agent or name,
        health=Health(status="ok", pool=name, version=name, uptime_seconds=60.0),
        pool=pool,
        alerts=(hostile_alert(name, pool=name),),
    )


def several_pools(first: str, second: str) -> Reading:
    """An agent serving two models named `first` and `second` in one budget."""
    share = PoolShare(
        budget_bytes=64 << 20, assigned_bytes=64 << 20, floor_pages=8, ceiling_pages=512,
        pinned=True, pools_total=2,
    )  # fmt: skip
    pools = (hostile_pool(first, share=share), hostile_pool(second, share=share))
    alerts = (hostile_alert(first, pool=first), hostile_alert(second, pool=second))
    return Reading(
        agent=first,
        health=Health(status="ok", pool=first, version="1", uptime_seconds=60.0),
        pool=pools[0],
        pools=pools,
        alerts=alerts,
        budget_bytes=64 << 20,
        assigned_bytes=64 << 20,
    )


def engine_reading(*models: str, source: str = "metrics", agent: str = "http://v:8000") -> Reading:
    """A vLLM serving `models`, with a hostile pitfall note."""
    figures = Figures(utilization_ratio=0.5, requests_running=1, requests_waiting=0)
    rows = tuple(ModelFigures(model, figures) for model in models)
    return Reading(
        agent=agent,
        engine="vllm",
        figures=figures,
        models=rows if len(rows) > 1 else (),
        model=models[0],
        source=source,
        notes=(f"note {CLIPBOARD}{STYLED}",),
    )


def test_clean_escapes_controls_and_keeps_brackets() -> None:
    assert clean(CLIPBOARD) == "\\x1b]52;c;ZXZpbA==\\x07"
    assert clean(CSI) == "\\x9b31m"
    assert clean(OVERRIDE + "\u2066\x7f\n\t") == "\\u202e\\u2066\\x7f\\n\\t"
    assert clean("a\\x1b") == "a\\\\x1b"  # the escape's characters sent as text read otherwise
    assert clean(STYLED) == STYLED and safe(CLOSE).plain == CLOSE
    assert clean("ünïcode ✓ 模型") == "ünïcode ✓ 模型"
    cut = clean(LONG)
    assert cut.startswith("m" * NAME_LIMIT + "…") and "4,744" in cut and len(cut) < 300


def test_the_detail_of_an_agent_shows_its_names_escaped() -> None:
    for name in HOSTILE:
        assert_inert(rendered(render.status([agent_reading(name)])), name)


def test_the_fleet_table_shows_agents_pools_alerts_and_reasons_escaped() -> None:
    for name in HOSTILE:
        down = Reading(agent=name, error=AgentServerError(name, f"said {name}", f"said {name}"))
        readings = [agent_reading(name), several_pools(name, "b"), engine_reading(name), down]
        for width in (400, 80):
            assert_inert(rendered(render.status(readings), width))
        assert clean(name)[:8] in rendered(render.status(readings))


def test_the_fleet_table_from_prometheus_shows_instances_and_models_escaped() -> None:
    readings = [
        engine_reading(*HOSTILE[:4], source="prometheus", agent=CLOSE),
        engine_reading(STYLED, source="prometheus", agent=TITLE),
    ]
    out = rendered(render.status(readings))
    assert_inert(out, CLOSE, STYLED, CLEAR, TITLE)


@pytest.mark.parametrize("source", ["metrics", "prometheus"])
def test_the_detail_of_an_engine_names_each_model_escaped(source: str) -> None:
    for models in [(CLOSE,), (CLOSE, STYLED), (CLIPBOARD, CSI, OVERRIDE, LONG)]:
        out = rendered(render.status([engine_reading(*models, source=source, agent=TITLE)]))
        named = [model for model in models if len(models) > 1 and model != LONG]  # titles wrap
        assert_inert(out, TITLE, *named)
    assert f"note \\x1b]52;c;ZXZpbA==\\x07{STYLED}" in out


def test_the_budget_and_the_pools_of_an_agent_show_their_names_escaped() -> None:
    for name in HOSTILE:
        reading = several_pools(name, STYLED)
        assert_inert(rendered(render.status([reading])), name, STYLED)
        pools = reading.pools
        for form in range(budget.LEGENDS):
            assert_inert(rendered(budget.legend(pools, reading.budget_bytes, name, form)), name)
        for _label, row in budget.share_rows(pools[0]):
            assert_inert(rendered(row))
        assert_inert(rendered(render.budget_table(pools, 64 << 20, 64 << 20)), name)


def test_tiers_show_their_policy_path_and_failures_escaped() -> None:
    for name in HOSTILE:
        pool = agent_reading(name).pool
        assert pool is not None
        out = "".join(rendered(row) for _label, row in tiers.tier_rows(pool))
        assert_inert(out, name)
        if name != LONG:
            assert flat(f"store {clean(name)} 2") in flat(out)


def test_pool_defrag_resize_release_and_sizing_show_names_escaped() -> None:
    share = PoolShare(
        budget_bytes=64 << 20, assigned_bytes=32 << 20, floor_pages=8, ceiling_pages=512,
        pools_total=2,
    )  # fmt: skip
    resized = ResizeResult(
        old_pages=1, new_pages=2, old_bytes=1, new_bytes=2, direction="grow", pages_moved=0,
        pages_evicted=0, pinned=True,
    )  # fmt: skip
    for name in HOSTILE:
        pool = hostile_pool(name, share=share)
        assert pool.last_defrag is not None
        views: list[RenderableType] = [
            render.pool_table(pool),
            render.sizing_table(pool, 4096),
            render.defrag_state(pool, named=True),
            render.defrag_result(pool.last_defrag, name),
            render.resize_result(resized, name),
            render.release_result(PoolRelease(pool=name, was_pinned=True)),
            render.release_result(PoolRelease(pool=name, was_pinned=False)),
        ]
        for view in views:
            assert_inert(rendered(view), name)


def test_the_alerts_listing_shows_every_word_escaped() -> None:
    for name in HOSTILE:
        alerts = [hostile_alert(name, pool=name), hostile_alert("Other", pool="other")]
        out = rendered(render.alerts_table(alerts))
        assert_inert(out, name, f"summary {name}", f"fix {name}")


def test_engine_row_labels_are_text_not_markup() -> None:
    label = engine.row_label(engine_reading(STYLED, CLOSE).per_pool()[1])
    assert label.plain == f"vLLM {CLOSE}" and not label.spans
