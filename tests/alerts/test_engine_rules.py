"""The rule files for vLLM and SGLang servers: generated from the alert catalog, named after the
engines' own metrics, checked and unit-tested by promtool, each alert with its runbook section,
and printed by `kvctl alerts rules --engine`."""

from __future__ import annotations

import re
import subprocess
from importlib import resources
from pathlib import Path
from string import Formatter

import pytest
import yaml
from typer.testing import CliRunner

from kvctl import api, engines
from kvctl.alerts.catalog import RULES_RUNBOOK_BASE
from kvctl.alerts.engine_rules import (
    ALERTS,
    PROFILES,
    engine_alerts,
    render_engine_rule_file,
    settings_read,
)
from kvctl.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "docs" / "alerts.md"
ENGINES = ("vllm", "sglang")


def rule_file(engine: str) -> Path:
    return ROOT / "alerts" / f"{engine}-rules.yml"


def unit_tests_of(engine: str) -> Path:
    return ROOT / "alerts" / f"{engine}-tests.yml"


def rules_of(text: str) -> list[dict]:
    [group] = yaml.safe_load(text)["groups"]
    return group["rules"]


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def metric_names(engine: engines.Engine) -> set[str]:
    """Every metric name the engine table gives the engine."""
    names = {
        engine.marker,
        engine.utilization,
        engine.waiting,
        engine.running,
        engine.preemptions,
        engine.prefix.hits,
        engine.prefix.queries,
        engine.prefix.gauge,
        engine.capacity.info,
        engine.capacity.block_size,
        engine.capacity.blocks,
        engine.capacity.tokens,
    }
    return {name for name in names if name}


def kvctl(*args: str):
    return CliRunner().invoke(app, list(args), env={"KVCTL_AGENT": None, "KVCTL_TOKEN": None})


@pytest.mark.parametrize("engine", ENGINES)
def test_the_committed_rule_file_is_the_generated_one(engine) -> None:
    assert rule_file(engine).read_text() == render_engine_rule_file(engine), (
        f"alerts/{engine}-rules.yml is stale: regenerate it with "
        f"`kvctl alerts rules --engine {engine} > alerts/{engine}-rules.yml`"
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_every_concept_is_alerted_for_every_engine(engine) -> None:
    alerts = [r["alert"] for r in rules_of(render_engine_rule_file(engine))]
    prefix = PROFILES[engine].prefix
    assert alerts == [prefix + a.concept for a in ALERTS]
    assert [a.concept for a in ALERTS] == [
        "KvCachePressureHigh",
        "PreemptionStorm",
        "PrefixHitRateLow",
        "QueueGrowing",
        "EngineDown",
        "EngineAbsent",
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_expressions_name_only_the_engines_metrics(engine) -> None:
    """Every series an expression selects is one of the engine's names in kvctl/engines.py (or
    Prometheus' `up`), and of the engine's scrape job."""
    known = metric_names(engines.BY_NAME[engine]) | {"up"}
    for rule in rules_of(render_engine_rule_file(engine)):
        expr = rule["expr"]
        selected = re.findall(r"([A-Za-z_:][\w:]*)\{", expr)
        assert selected and set(selected) <= known, (rule["alert"], set(selected) - known)
        colon_names = set(re.findall(r"[A-Za-z_][\w]*:[\w:]+", expr))
        assert colon_names <= known, (rule["alert"], colon_names - known)
        assert expr.count("{") == expr.count(f'{{job="{engine}"}}'), rule["alert"]


@pytest.mark.parametrize("engine", ENGINES)
def test_each_alert_has_severity_for_texts_and_its_runbook_link(engine) -> None:
    for rule in rules_of(render_engine_rule_file(engine)):
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["for"]
        notes = rule["annotations"]
        assert set(notes) == {"summary", "description", "remediation", "runbook_url"}
        assert "Likely cause" in notes["description"] or rule["alert"].endswith(("Down", "Absent"))
        assert notes["runbook_url"] == f"{RULES_RUNBOOK_BASE}#{rule['alert'].lower()}"


@pytest.mark.parametrize("engine", ENGINES)
def test_remediations_name_the_engines_own_knobs(engine) -> None:
    profile = PROFILES[engine]
    others = {k for p in PROFILES.values() if p is not profile for k in p.knobs} - set(
        profile.knobs
    )
    for rule in rules_of(render_engine_rule_file(engine)):
        flags = set(re.findall(r"`(--[a-z-]+)", rule["annotations"]["remediation"]))
        assert flags <= set(profile.knobs), (rule["alert"], flags - set(profile.knobs))
        assert not flags & others
        if not rule["alert"].endswith("Absent"):
            assert flags, f"{rule['alert']} names no {profile.engine.title} knob"


def test_the_knobs_each_engine_must_name() -> None:
    vllm = render_engine_rule_file("vllm")
    for knob in (
        "--gpu-memory-utilization",
        "--max-num-seqs",
        "--kv-cache-memory-bytes",
        "--enable-prefix-caching",
        "--max-num-batched-tokens",
    ):
        assert f"`{knob}`" in vllm
    sglang = render_engine_rule_file("sglang")
    for knob in (
        "--mem-fraction-static",
        "--max-running-requests",
        "--schedule-conservativeness",
    ):
        assert f"`{knob}`" in sglang
    assert "`--disable-radix-cache` must not be set" in sglang


def test_thresholds_are_kvctls_settings_and_the_header_names_them() -> None:
    settings = api.AlertSettings(
        for_s=120, pressure_high=0.9, prefix_hit_min=0.2, preemptions_per_minute_max=12
    )
    for engine in ENGINES:
        text = render_engine_rule_file(engine, settings)
        rules = {r["alert"]: r for r in rules_of(text)}
        prefix = PROFILES[engine].prefix
        pressure = rules[f"{prefix}KvCachePressureHigh"]
        assert pressure["expr"].endswith("> 0.9") and pressure["for"] == "10m"
        assert "of the KV cache, more than 90%" in pressure["annotations"]["description"]
        assert rules[f"{prefix}PreemptionStorm"]["expr"].endswith("* 60 > 12.0")
        assert "< 0.2" in rules[f"{prefix}PrefixHitRateLow"]["expr"]
        assert rules[f"{prefix}PrefixHitRateLow"]["for"] == "20m"
        assert rules[f"{prefix}EngineDown"]["for"] == "2m"
        assert rules[f"{prefix}EngineAbsent"]["for"] == "10m"
        assert settings_read(engine) == (
            "for_s",
            "pressure_high",
            "prefix_hit_min",
            "preemptions_per_minute_max",
        )
        assert (
            "#   alerts.for_s=120 alerts.pressure_high=0.9 alerts.prefix_hit_min=0.2 "
            "alerts.preemptions_per_minute_max=12\n"
        ) in text


@pytest.mark.parametrize("engine", ENGINES)
def test_the_prefix_alert_stands_down_during_a_preemption_storm(engine) -> None:
    """A storm evicts cached prefixes (and older vLLM counted its recomputed tokens as hits,
    vLLM issue 25780): the prefix alert is gated on the storm's own condition, and says so."""
    rules = {r["alert"]: r for r in rules_of(render_engine_rule_file(engine))}
    prefix = PROFILES[engine].prefix
    storm = rules[f"{prefix}PreemptionStorm"]
    hits = rules[f"{prefix}PrefixHitRateLow"]
    assert hits["expr"].endswith(f"\nunless {storm['expr']}")
    assert f"{prefix}PreemptionStorm the alert to act on" in hits["annotations"]["description"]
    assert f"{prefix}PrefixHitRateLow stands down" in storm["annotations"]["description"]
    if engine == "vllm":
        assert "issue 25780" in hits["annotations"]["description"]
        pressure = rules["VllmKvCachePressureHigh"]["annotations"]["description"]
        assert "cached prefix blocks" in pressure


@pytest.mark.parametrize("engine", ENGINES)
def test_job_and_runbook_base_are_parameters(engine) -> None:
    text = render_engine_rule_file(engine, runbook_base="https://wiki.example/kv/", job="llm")
    for rule in rules_of(text):
        assert 'job="llm"' in rule["expr"] and f'job="{engine}"' not in rule["expr"]
        assert rule["annotations"]["runbook_url"].startswith("https://wiki.example/kv#")
    assert 'scrape job to be named "llm"' in text


@pytest.mark.parametrize("engine", ENGINES)
def test_templates_only_use_labels_the_expression_keeps(engine) -> None:
    """A `{label}` the expression drops would render empty in a notification."""
    profile = PROFILES[engine]
    for concept, alert in zip(ALERTS, engine_alerts(engine), strict=True):
        known = {"value", *concept.labels, *api.AlertSettings.model_fields}
        for template in (alert.summary, alert.description, alert.remediation):
            fields = {f for _, f, _, _ in Formatter().parse(template) if f is not None}
            assert fields <= known, (alert.name, fields - known)
        if "model_name" in concept.labels:
            assert "{model_name}" in alert.summary, alert.name
        assert profile.engine.title in alert.summary


def test_unknown_engines_have_no_rule_file() -> None:
    with pytest.raises(ValueError, match="no rule file for engine 'trtllm'"):
        render_engine_rule_file("trtllm")


# ---- promtool -------------------------------------------------------------------------------


def test_promtool_accepts_the_rule_files(tool, tmp_path) -> None:
    custom = tmp_path / "custom.yml"
    custom.write_text(render_engine_rule_file("vllm", api.AlertSettings(for_s=0), job="x"))
    paths = [str(rule_file(e)) for e in ENGINES] + [str(custom)]
    result = run(tool("promtool"), "check", "rules", *paths)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(f"SUCCESS: {len(ALERTS)} rules found") == 3


@pytest.mark.parametrize("engine", ENGINES)
def test_promtool_unit_tests_pass(tool, engine) -> None:
    result = run(tool("promtool"), "test", "rules", str(unit_tests_of(engine)))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("engine", ENGINES)
def test_the_unit_tests_cover_every_alert_firing_and_not_firing(engine) -> None:
    suite = yaml.safe_load(unit_tests_of(engine).read_text())
    assert suite["rule_files"] == [f"{engine}-rules.yml"]
    firing, quiet, annotated = set(), set(), set()
    for group in suite["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
            if any("exp_annotations" in a for a in case.get("exp_alerts", [])):
                annotated.add(case["alertname"])
    names = {a.name for a in engine_alerts(engine)}
    assert firing == names
    assert quiet == names
    assert annotated == names


# ---- the runbook ----------------------------------------------------------------------------


def github_anchor(heading: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def sections() -> dict[str, str]:
    parts = re.split(r"^## ", RUNBOOK.read_text(), flags=re.MULTILINE)[1:]
    return {github_anchor(p.split("\n", 1)[0]): p for p in parts}


@pytest.mark.parametrize("engine", ENGINES)
def test_every_alert_has_a_runbook_section_at_its_anchor(engine) -> None:
    found = sections()
    for rule in rules_of(render_engine_rule_file(engine)):
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in found, f"docs/alerts.md has no `## {rule['alert']}` section"
        for part in ("Meaning", "Likely causes", "What to run", "How to tune"):
            assert f"**{part}.**" in found[anchor], f"{rule['alert']} lacks **{part}.**"


def test_the_agent_serves_the_same_runbook() -> None:
    """The packaged runbook (GET /runbook) is docs/alerts.md itself."""
    served = resources.files("kvctl.alerts").joinpath("runbook.md").read_text(encoding="utf-8")
    assert served == RUNBOOK.read_text(encoding="utf-8")
    assert "## VllmPrefixHitRateLow" in served


# ---- the CLI --------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_the_cli_prints_the_engines_file(engine) -> None:
    result = kvctl("alerts", "rules", "--engine", engine)
    assert result.exit_code == 0, result.output
    assert result.stdout == rule_file(engine).read_text()
    custom = kvctl(
        "alerts", "rules", "--engine", engine, "--job", "llm", "--set", "alerts.for_s=30"
    )
    assert custom.stdout == render_engine_rule_file(engine, api.AlertSettings(for_s=30), job="llm")


def test_the_cli_default_is_kvctls_own_file() -> None:
    assert kvctl("alerts", "rules").stdout == (ROOT / "alerts" / "kvctl-rules.yml").read_text()
    assert kvctl("alerts", "rules", "--engine", "kvctl").stdout == kvctl("alerts", "rules").stdout


@pytest.mark.parametrize("engine", ["trtllm", "bogus", ""])
def test_a_bad_engine_is_a_one_line_usage_error(engine) -> None:
    result = kvctl("alerts", "rules", "--engine", engine)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == (
        f"kvctl: --engine {engine!r}: no rule file for it; expected one of kvctl, vllm, sglang\n"
    )
