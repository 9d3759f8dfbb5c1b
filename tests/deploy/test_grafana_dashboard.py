"""The Grafana dashboard (agent/grafana-dashboard.json) and the rule file query only series that
exist: the agent's metrics (the promised families and docs/metrics.md), the recording rules of the
generated rule file, and Prometheus' own ALERTS and up."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from local_tools import find_binary
from promised_metrics import TIERED, series_names

from kvctl.alerts import render_rule_file

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "agent" / "grafana-dashboard.json"

PROMISED_METRICS = series_names() | {"kvctl_build_info"}
PROMETHEUS_SERIES = {"ALERTS", "up"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}
KEYWORDS |= {"bool", "offset", "inf", "nan"}
KEYWORDS |= {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk"}
KEYWORDS |= {"quantile", "count_values"}  # aggregations: `sum by (x) (...)` has no `(` after sum


def documented_metrics() -> set[str]:
    """Series names in docs/metrics.md's table (generated from the agent's metric table)."""
    path = ROOT / "docs" / "metrics.md"
    names = set(re.findall(r"^\| `(kvctl_\w+)` \|", path.read_text(), re.MULTILINE))
    histograms = {n for n in names if n.endswith("_seconds")}
    return names | {f"{h}_{suffix}" for h in histograms for suffix in ("bucket", "sum", "count")}


def recorded() -> set[str]:
    [group] = yaml.safe_load(render_rule_file())["groups"]
    return {r["record"] for r in group["rules"] if "record" in r}


def known_series() -> set[str]:
    return PROMISED_METRICS | documented_metrics() | recorded() | PROMETHEUS_SERIES


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (functions, keywords, labels left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", expr)
    names = set()
    for match in re.finditer(r"(?<![\w$.])[A-Za-z_:][\w:]*", expr):
        word, rest = match.group(0), expr[match.end() :].lstrip()
        if not rest.startswith("(") and word.lower() not in KEYWORDS:
            names.add(word)
    return names


def panels(dashboard: dict) -> list[dict]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression: panel targets, and the series of `label_values(...)` variables."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else ""
        match = re.fullmatch(r"label_values\((.+),\s*\w+\)", text)
        if match:
            exprs.append(match.group(1))
    return exprs


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_metric_names_are_found_in_expressions() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (le, pool) "
        '(rate(kvctl_defrag_duration_seconds_bucket{pool=~"$pool"}[$__rate_interval])))'
    )
    assert metric_names(expr) == {"kvctl_defrag_duration_seconds_bucket"}
    assert metric_names("a:b:c * 60 > 30 or (x and ignoring(alertname) ALERTS{a='b'})") == {
        "a:b:c",
        "x",
        "ALERTS",
    }


def test_every_dashboard_query_names_existing_series(dashboard) -> None:
    known = known_series()
    for expr in dashboard_queries(dashboard):
        names = metric_names(expr)
        assert names, f"no series in {expr!r}"
        assert names <= known, f"unknown series {names - known} in {expr!r}"


def test_the_dashboard_has_the_panels_an_operator_needs(dashboard) -> None:
    stats = " ".join(
        t["expr"] for p in panels(dashboard) if p["type"] == "stat" for t in p["targets"]
    )
    for headline in (
        "kvctl:alloc_success:ratio_rate5m",
        "kvctl_pool_fragmentation_ratio",
        "kvctl_pool_utilization_ratio",
        "kvctl:prefix_hit:ratio_rate5m",
    ):
        assert headline in stats
    [pool_map] = [p for p in panels(dashboard) if p["title"] == "Pages: used / cached / free"]
    assert pool_map["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    series = [metric_names(t["expr"]) for t in pool_map["targets"]]
    assert series == [
        {"kvctl_pool_used_pages"},
        {"kvctl_pool_cached_pages"},
        {"kvctl_pool_free_pages"},
    ]
    queries = " ".join(dashboard_queries(dashboard))
    assert "kvctl_defrag_runs_total" in queries and "kvctl:defrag_pages_moved:rate5m" in queries
    assert 'ALERTS{alertname=~"Kvctl.+"' in queries


def test_panel_layout_is_consistent(dashboard) -> None:
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]


def test_the_rule_file_names_existing_series() -> None:
    known = known_series()
    [group] = yaml.safe_load(render_rule_file())["groups"]
    for rule in group["rules"]:
        queries = [rule["expr"]]
        for annotation in rule.get("annotations", {}).values():
            queries += [q.replace("%q", '"x"') for q in re.findall(r'printf "([^"]+)"', annotation)]
        for query in (q for q in queries if not q.startswith("%")):
            names = metric_names(query)
            assert names <= known, f"{rule.get('alert') or rule['record']}: {names - known}"


def test_every_dashboard_query_parses_as_promql(dashboard, tmp_path) -> None:
    promtool = find_binary("promtool")
    rules = [
        {"record": f"dashboard:query_{i}", "expr": re.sub(r"\$\w+", "1m", expr)}
        for i, expr in enumerate(dashboard_queries(dashboard))
    ]
    for rule in rules:  # label values: any string is a valid regex for `=~`
        rule["expr"] = rule["expr"].replace('"1m"', '".*"')
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_plots_what_the_agents_alerts_read(dashboard) -> None:
    """Pressure (not utilisation) trips KvctlPoolNearlyFull, and the queue alerts read the wait
    and the stall: an operator looking at the dashboard sees the number that fired."""
    queries = " ".join(dashboard_queries(dashboard))
    for series in (
        "kvctl_pool_pressure_ratio",
        "kvctl_oldest_waiting_seconds",
        "kvctl_queue_stalled_seconds",
    ):
        assert series in queries, series
    [queue] = [
        p for p in panels(dashboard) if "kvctl_queue_stalled_seconds" in str(p.get("targets"))
    ]
    assert queue["fieldConfig"]["defaults"]["unit"] == "s"


def test_the_tiers_row_plots_what_the_tier_alerts_read(dashboard) -> None:
    """Hit tokens by tier, tier bytes against capacity and the disk's free space, bandwidth,
    load cost against prefill cost, reuse and failures, each in the Tiers row."""
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    titles = [r["title"] for r in rows]
    assert "Tiers" in titles
    start = dashboard["panels"].index(rows[titles.index("Tiers")])
    following = dashboard["panels"][start + 1 :]
    end = next((i for i, p in enumerate(following) if p["type"] == "row"), len(following))
    tier_panels = following[:end]
    queries = {
        name
        for panel in tier_panels
        for target in panel["targets"]
        for name in metric_names(target["expr"])
    }
    assert queries == {
        "kvctl_prefix_cache_hits_tokens_total",
        "kvctl_kv_tier_used_bytes",
        "kvctl_kv_tier_capacity_bytes",
        "kvctl_kv_tier_filesystem_free_bytes",
        "kvctl_kv_tier_loaded_bytes_total",
        "kvctl_kv_tier_stored_bytes_total",
        "kvctl:tier_load_seconds_per_token:rate5m",
        "kvctl_prefill_seconds_per_token",
        "kvctl:tier_reuse:ratio_rate5m",
        "kvctl_kv_tier_store_failures_total",
        "kvctl_kv_tier_load_failures_total",
    }
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in tier_panels}
    assert units["Tier used vs capacity"] == "bytes"
    assert units["Load seconds per token vs prefill"] == "s"
    [hits] = [p for p in tier_panels if "by tier" in p["title"]]
    assert hits["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert "tier" in hits["targets"][0]["expr"].split("sum by (", 1)[1].split(")", 1)[0]


_AGGREGATED = re.compile(r"\b(?:sum|avg|max|min)\s+(by|without)\s*\(([^)]*)\)\s*\((?:\s*\w+\()?$")


def keeps_or_sums_tier(expr: str, name: str) -> bool:
    """Whether every use of `name` in `expr` picks tiers with a `tier` matcher, or is summed
    by labels (which keep `tier` apart or add the tiers up) or without `tier`, directly around
    the series or around the one function (`rate`) applied to it."""
    for match in re.finditer(rf"\b{name}\b", expr):
        after = expr[match.end() :]
        if after.startswith("{") and "tier" in after[: after.index("}")]:
            continue
        aggregation = _AGGREGATED.search(expr[: match.start()])
        if aggregation is None:
            return False
        how, labels = aggregation.groups()
        if how == "without" and "tier" not in re.split(r"\s*,\s*", labels.strip()):
            return False  # `by` either names tier or sums the tiers up; `without` must name it
    return True


def test_queries_of_tiered_series_never_mix_tiers_with_untiered_series(dashboard) -> None:
    """Prefix hits are one series per tier: summed without `tier` (the hit ratio), or kept
    apart by it (hits by tier), never divided as they are by the untiered lookups."""
    [group] = yaml.safe_load(render_rule_file())["groups"]
    exprs = [*dashboard_queries(dashboard), *(r["expr"] for r in group["rules"])]
    uses = 0
    for expr in exprs:
        for name in TIERED & metric_names(expr):
            uses += 1
            assert keeps_or_sums_tier(expr, name), expr
    assert uses >= 3  # the hit ratio, the load cost per token, the hits by tier
    hits = "kvctl_prefix_cache_hits_tokens_total"
    assert not keeps_or_sums_tier(f"rate({hits}[5m]) / rate(kvctl_x_total[5m])", hits)
    assert not keeps_or_sums_tier(f"sum without (instance) (rate({hits}[5m]))", hits)
    assert keeps_or_sums_tier(f"sum by (pool) (rate({hits}[5m]))", hits)
    assert keeps_or_sums_tier(f"sum without (tier) (rate({hits}[5m])) / rate(x[5m])", hits)
