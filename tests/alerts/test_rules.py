"""The Prometheus side: the generated rule file, its promtool unit tests, the example
Alertmanager configuration and the runbook anchors the alerts link to."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from string import Formatter

import pytest
import yaml

from kvctl import api
from kvctl.alerts import ALL_ALERT_NAMES, DEFINITIONS, render_rule_file
from kvctl.alerts.catalog import FACTS
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


def test_every_alert_and_recording_rule_is_in_the_file() -> None:
    rules = rules_of(render_rule_file())
    assert [r["alert"] for r in rules if "alert" in r] == list(ALL_ALERT_NAMES)
    assert [r["record"] for r in rules if "record" in r] == [name for name, _ in RECORDING_RULES]
    for rule in (r for r in rules if "alert" in r):
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert set(rule["annotations"]) == {"summary", "description", "remediation", "runbook_url"}
        assert rule["annotations"]["runbook_url"] == f"docs/alerts.md#{rule['alert'].lower()}"


def test_thresholds_and_durations_follow_the_settings() -> None:
    settings = api.AlertSettings(for_s=120, fragmentation_max=0.7, utilization_low=0.1)
    rules = {r.get("alert"): r for r in rules_of(render_rule_file(settings))}
    fragmentation = rules["KvctlFragmentationHigh"]
    assert fragmentation["expr"].startswith("kvctl_pool_fragmentation_ratio > 0.7\n")
    assert "kvctl_pool_fragmentation_ratio > 0.6\n" in fragmentation["expr"]  # clear level
    assert fragmentation["for"] == "2m"
    assert rules["KvctlPoolOverProvisioned"]["for"] == "1h"  # 30 × alert-for
    assert "kvctl_pool_utilization_ratio < 0.1\n" in rules["KvctlPoolOverProvisioned"]["expr"]
    # a trigger with no room for a clear level has no hysteresis branch
    assert rules["KvctlAllocationFailures"]["expr"] == "kvctl:alloc_success:ratio_rate5m < 1"


def test_runbook_base_and_job_are_parameters() -> None:
    text = render_rule_file(runbook_base="https://runbooks.example/alerts.md", job="llm-kv")
    rules = {r.get("alert"): r for r in rules_of(text)}
    assert rules["KvctlAgentDown"]["expr"] == 'up{job="llm-kv"} == 0'
    assert rules["KvctlPoolNearlyFull"]["annotations"]["runbook_url"] == (
        "https://runbooks.example/alerts.md#kvctlpoolnearlyfull"
    )


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
    custom.write_text(render_rule_file(api.AlertSettings(for_s=0, preemptions_per_minute_max=5)))
    result = run(tool("promtool"), "check", "rules", str(RULES), str(custom))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 15 rules found" in result.stdout


def test_promtool_unit_tests_of_every_alert_pass(tool) -> None:
    result = run(tool("promtool"), "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_unit_tests_cover_every_alert_firing_and_not_firing() -> None:
    firing, quiet = set(), set()
    for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in group["alert_rule_test"]:
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert firing == set(ALL_ALERT_NAMES)
    assert quiet == set(ALL_ALERT_NAMES)


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
    assert {d.anchor for d in DEFINITIONS} <= anchors


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
    templates = (
        definition.summary,
        definition.headline,
        definition.rule_remediation(api.AlertSettings()),
    )
    for template in templates:
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
    match = re.search(rf"`{setting}` \(([\d.]+)\)", row)
    assert match, f"the runbook's row of {definition.name} does not name `{setting}`"
    default = definition.threshold.trigger(api.AlertSettings())
    assert float(match.group(1)) == default
    assert definition.severity in row
