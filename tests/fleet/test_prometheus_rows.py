"""Prometheus's answers turned into fleet rows: one reading per instance with a row per pool or
model, down targets as down rows, alerts on the row they are about, and "–" for a column an
engine leaves out."""

from __future__ import annotations

import pytest

from kvctl.prometheus_fleet import (
    COLUMNS,
    ENGINE_LABEL,
    MODEL_LABEL,
    PrometheusFleet,
    Series,
    build_readings,
    selector_matchers,
)


def row(engine: str, instance: str, model: str, value: float | None, job: str = "j") -> Series:
    labels = {"job": job, "instance": instance, MODEL_LABEL: model, ENGINE_LABEL: engine}
    return Series(labels, value)


def up(instance: str, value: float, job: str = "j") -> Series:
    return Series({"__name__": "up", "job": job, "instance": instance}, value)


def alert(name: str, instance: str, **labels: str) -> Series:
    return Series({"alertname": name, "instance": instance, "severity": "warning", **labels}, 1)


def answers() -> dict[str, list[Series]]:
    return {
        "up": [up("a:8477", 1), up("v:8000", 1), up("gone:8000", 0)],
        "util": [
            row("kvctl", "a:8477", "chat", 0.5),
            row("kvctl", "a:8477", "code", 0.25),
            row("vllm", "v:8000", "m", 0.9),
        ],
        "frag": [row("kvctl", "a:8477", "chat", 0.1), row("kvctl", "a:8477", "code", 0.2)],
        "running": [row("vllm", "v:8000", "m", 7)],
        "prefix": [row("vllm", "v:8000", "m", None)],  # 0/0: nothing asked in the window
        "alerts": [
            alert("KvctlPoolNearlyFull", "a:8477", pool="code"),
            alert("KvctlAgentDown", "gone:8000"),
        ],
    }


def test_a_row_per_instance_and_model_with_its_own_figures() -> None:
    readings = build_readings(answers())
    assert [r.agent for r in readings] == ["http://a:8477", "http://gone:8000", "http://v:8000"]
    agent, gone, vllm = readings
    assert agent.engine == "kvctl" and agent.several
    rows = agent.per_pool()
    assert [
        (r.row_name, r.row_figures.utilization_ratio, r.row_figures.fragmentation_ratio)
        for r in rows
    ] == [("chat", 0.5, 0.1), ("code", 0.25, 0.2)]
    assert [a.name for a in rows[1].alerts] == ["KvctlPoolNearlyFull"] and not rows[0].alerts
    assert vllm.engine == "vllm" and vllm.row_name == "m" and not vllm.several
    figures = vllm.row_figures
    assert (figures.utilization_ratio, figures.requests_running) == (0.9, 7)
    assert figures.prefix_hit_ratio is None and figures.fragmentation_ratio is None
    assert vllm.notes  # its pitfalls come with it
    assert not gone.up and "up == 0" in str(gone.error)
    assert [a.name for a in gone.alerts] == ["KvctlAgentDown"]


def test_an_instance_scraped_by_a_second_job_that_fails_is_still_up() -> None:
    data = answers()
    data["up"].append(up("v:8000", 0, job="other"))
    vllm = build_readings(data)[-1]
    assert vllm.up


def test_every_column_is_one_query_over_every_engine() -> None:
    fleet = PrometheusFleet("http://prom:9090", '{job=~"vllm|kvctl"}')
    queries = fleet.queries()
    assert {column.key for column in COLUMNS} <= set(queries)
    util = queries["util"]
    for metric in (
        "kvctl_pool_utilization_ratio",
        "vllm:kv_cache_usage_perc",
        "sglang:token_usage",
        "trtllm_kv_cache_utilization",
    ):
        assert f'{metric}{{job=~"vllm|kvctl"}}' in util
    assert "{S}" not in "".join(queries.values())
    assert 'ALERTS{alertstate="firing", job=~"vllm|kvctl"}' in queries["alerts"]
    assert 'kvctl_alerts_active{state="firing", job=~"vllm|kvctl"}' in queries["alerts"]
    assert 'kvctl_engine", "kvctl"' in queries["frag"]
    assert 'kvctl_engine", "vllm"' not in queries["frag"]  # engines export none


@pytest.mark.parametrize("selector", ['job="x"', "{job", "job"])
def test_a_selector_needs_braces(selector: str) -> None:
    with pytest.raises(ValueError, match="label matchers in braces"):
        selector_matchers(selector)
