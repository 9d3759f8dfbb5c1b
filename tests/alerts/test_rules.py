"""The Prometheus side: the generated rule file (recording rules, and only the alerts an agent
cannot raise itself), its promtool unit tests, the example Alertmanager configuration and the
runbook the alerts link to."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from string import Formatter
from urllib.parse import urlsplit

import pytest
import yaml

from kvctl import api
from kvctl.alerts import ALL_ALERT_NAMES, DEFINITIONS, RULE_ONLY, render_rule_file
from kvctl.alerts.catalog import FACTS, RULES_RUNBOOK_BASE
from kvctl.alerts.rules import RECORDING_RULES, duration

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "kvctl-rules.yml"
RULE_TESTS = ROOT / "alerts" / "tests.yml"
AM_EXAMPLE = ROOT / "alerts" / "alertmanager.example.yml"
RUNBOOK = ROOT / "docs" / "alerts.md"


def rules_of(text: str) -> list[dict]:
    [group] = yaml.safe_load(text)["groups"]
    return group["rules"]


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_committed_rule_file_is_the_generated_one() -> None:
    assert RULES.read_text() == render_rule_file(), (
        "alerts/kvctl-rules.yml is stale: regenerate it with "
        "`python -c 'from kvctl.alerts import render_rule_file; "
        'print(render_rule_file(), end="")\' > alerts/kvctl-rules.yml`'
    )


def test_the_file_owns_only_what_an_agent_cannot_say() -> None:
    """Per-node alerts are pushed by the agents; a rule for one of them would reach
    Alertmanager a second time."""
    rules = rules_of(render_rule_file())
    alerts = [r["alert"] for r in rules if "alert" in r]
    assert alerts == ["KvctlAgentDown", "KvctlAgentAbsent", "KvctlFleetPressureHigh"]
    assert not set(alerts) & {d.name for d in DEFINITIONS}
    assert set(alerts) | {d.name for d in DEFINITIONS} == set(ALL_ALERT_NAMES)
    assert [r["record"] for r in rules if "record" in r] == [name for name, _ in RECORDING_RULES]
    for rule in (r for r in rules if "alert" in r):
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert set(rule["annotations"]) == {"summary", "description", "remediation", "runbook_url"}
        assert rule["annotations"]["runbook_url"] == (
            f"{RULES_RUNBOOK_BASE}#{rule['alert'].lower()}"
        )
        link = urlsplit(rule["annotations"]["runbook_url"])
        assert link.scheme == "https" and link.netloc.endswith(".invalid")  # plainly unset


def test_durations_and_the_fleet_threshold_follow_the_settings() -> None:
    settings = api.AlertSettings(for_s=120, pressure_high=0.9)
    rules = {r.get("alert"): r for r in rules_of(render_rule_file(settings))}
    assert rules["KvctlAgentDown"]["for"] == "2m"
    assert rules["KvctlAgentAbsent"]["for"] == "10m"  # 5 × alert-for
    fleet = rules["KvctlFleetPressureHigh"]
    assert fleet["for"] == "10m"
    assert 'kvctl_pool_pressure_ratio{job="kvctl-agent"} > 0.9)' in fleet["expr"]
    assert "more than 90% of the pool" in fleet["annotations"]["description"]


def test_runbook_base_and_job_are_parameters() -> None:
    text = render_rule_file(runbook_base="https://runbooks.example/kvctl/", job="llm-kv")
    rules = {r.get("alert"): r for r in rules_of(text)}
    assert rules["KvctlAgentDown"]["expr"] == 'up{job="llm-kv"} == 0'
    assert rules["KvctlAgentAbsent"]["expr"] == 'absent(up{job="llm-kv"})'
    assert 'kvctl_pool_pressure_ratio{job="llm-kv"}' in rules["KvctlFleetPressureHigh"]["expr"]
    assert rules["KvctlAgentDown"]["annotations"]["runbook_url"] == (
        "https://runbooks.example/kvctl#kvctlagentdown"
    )
    assert 'scrape job to be named "llm-kv"' in text


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0, "0s"),
        (15, "15s"),
        (60, "1m"),
        (90, "1m30s"),
        (1800, "30m"),
        (5400, "1h30m"),
        (0.5, "500ms"),
    ],
)
def test_durations(seconds, expected) -> None:
    assert duration(seconds) == expected


def test_promtool_accepts_the_rule_file(tool, tmp_path) -> None:
    custom = tmp_path / "custom.yml"
    custom.write_text(render_rule_file(api.AlertSettings(for_s=0, pressure_high=0.5)))
    result = run(tool("promtool"), "check", "rules", str(RULES), str(custom))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS: 11 rules found") == 2


def test_promtool_unit_tests_of_every_alert_pass(tool) -> None:
    result = run(tool("promtool"), "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_unit_tests_cover_every_rule_firing_and_not_firing() -> None:
    firing, quiet = set(), set()
    for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert firing == {r.name for r in RULE_ONLY}
    assert quiet == {r.name for r in RULE_ONLY}


def test_every_recording_rule_over_tiered_series_has_a_unit_test() -> None:
    """Prefix hits carry `tier`: a rule that divides them by an untiered series must sum the
    tiers away, or it matches nothing; promtool checks each such rule's value."""
    tested = {
        case["expr"]
        for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in group.get("promql_expr_test", [])
    }
    tiered = {
        name
        for name, expr in RECORDING_RULES
        if "kvctl_kv_tier_" in expr or "kvctl_prefix_cache_hits_tokens_total" in expr
    }
    assert tiered == {
        "kvctl:prefix_hit:ratio_rate5m",
        "kvctl:tier_reuse:ratio_rate5m",
        "kvctl:tier_load_seconds_per_token:rate5m",
    }
    assert tiered <= tested
    [hit_ratio] = [
        expr for name, expr in RECORDING_RULES if name == "kvctl:prefix_hit:ratio_rate5m"
    ]
    assert hit_ratio.startswith("sum without (tier) (rate(kvctl_prefix_cache_hits_tokens_total")


def test_a_down_agent_inhibits_its_own_alerts_by_instance() -> None:
    """The agent's pushed alerts and Prometheus' KvctlAgentDown carry the same `instance`, so
    the example can silence a down node's stale alerts."""
    config = yaml.safe_load(AM_EXAMPLE.read_text())
    [rule] = [
        r for r in config["inhibit_rules"] if r["source_matchers"] == ['alertname="KvctlAgentDown"']
    ]
    assert rule["equal"] == ["instance"]
    assert 'alertname=~"Kvctl.+"' in rule["target_matchers"]


def test_amtool_accepts_the_example_alertmanager_config(tool) -> None:
    result = run(tool("amtool"), "check-config", str(AM_EXAMPLE))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("severity", "receiver"),
    [("critical", "kvctl-pager"), ("warning", "kvctl-chat"), ("info", "kvctl-tickets")],
)
def test_the_example_routes_by_severity(tool, severity, receiver) -> None:
    result = run(
        tool("amtool"),
        "config",
        "routes",
        "test",
        f"--config.file={AM_EXAMPLE}",
        f"severity={severity}",
        "alertname=KvctlPoolNearlyFull",
    )
    assert result.stdout.strip() == receiver, result.stdout + result.stderr


def github_anchor(heading: str) -> str:
    """GitHub's slug of a heading: lower case, punctuation dropped, spaces to hyphens."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def test_every_alert_has_a_runbook_section_at_its_anchor() -> None:
    headings = re.findall(r"^## (.+)$", RUNBOOK.read_text(), flags=re.MULTILINE)
    anchors = {github_anchor(h) for h in headings}
    for name in (*ALL_ALERT_NAMES, "KvctlTestAlert"):
        assert name.lower() in anchors, f"docs/alerts.md has no `## {name}` section"
    assert {d.anchor for d in DEFINITIONS} | {r.anchor for r in RULE_ONLY} <= anchors


def test_the_runbook_names_every_alert_setting() -> None:
    text = RUNBOOK.read_text()
    for name in api.AlertSettings.model_fields:
        assert f"`{name}`" in text or f"`alerts.{name}" in text, f"docs/alerts.md lacks {name}"


def test_every_runbook_section_has_its_four_parts() -> None:
    sections = re.split(r"^## ", RUNBOOK.read_text(), flags=re.MULTILINE)[1:]
    for section in sections:
        name = section.split("\n", 1)[0]
        if name not in ALL_ALERT_NAMES:
            continue
        for part in ("Meaning", "Likely causes", "What to run", "How to tune"):
            assert f"**{part}.**" in section, f"{name} lacks **{part}.**"


@pytest.mark.parametrize("definition", DEFINITIONS, ids=lambda d: d.name)
def test_text_templates_only_use_known_fields(definition) -> None:
    known = {"value", "pool", "instance", "agent", *definition.labels, *FACTS}
    for template in (definition.summary, definition.headline):
        fields = {field for _, field, _, _ in Formatter().parse(template) if field is not None}
        assert fields <= known, f"unknown fields {fields - known} in {template!r}"


@pytest.mark.parametrize("alert", RULE_ONLY, ids=lambda a: a.name)
def test_rule_templates_only_use_labels_the_expression_keeps(alert) -> None:
    """A `{label}` the expression aggregates away would render empty in a notification."""
    kept = {"KvctlAgentDown": {"instance", "job"}, "KvctlAgentAbsent": {"job"}}
    labels = kept.get(alert.name, {"job", "pool"})
    known = {"value", *labels, *api.AlertSettings.model_fields}
    if "instance" in labels:
        known.add("agent")
    for template in (alert.summary, alert.description, alert.remediation):
        fields = {field for _, field, _, _ in Formatter().parse(template) if field is not None}
        assert fields <= known, f"unknown fields {fields - known} in {template!r}"


@pytest.mark.parametrize("definition", DEFINITIONS, ids=lambda d: d.name)
def test_the_runbook_table_states_each_threshold_and_default(definition) -> None:
    [row] = [
        line
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith(f"| {definition.name} |")
    ]
    setting = definition.threshold.setting
    match = re.search(rf"`{setting}` \(([\d.]+)", row)
    assert match, f"the runbook's row of {definition.name} does not name `{setting}`"
    default = definition.threshold.trigger(api.AlertSettings())
    assert float(match.group(1)) == default
    assert definition.severity in row
    if definition.escalation is not None:
        assert definition.escalation.severity in row
