"""The deployment artefacts under agent/ parse and agree with each other: the example config
has every flag as a key, the Kubernetes objects select each other and bind publicly only with a
token, and the scrape job is the one the rule file expects."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from kvctl.alerts import render_rule_file
from kvctl.alerts.catalog import AGENT_JOB

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "agent"
K8S = AGENT / "kubernetes"

FLAG_KEYS = {
    "host",
    "port",
    "model",
    "device",
    "page_size",
    "pool_pages",
    "pool_memory",
    "gpu_memory_fraction",
    "segment_pages",
    "max_pool_pages",
    "prefix_cache",
    "token_file",
    "alertmanager_url",
    "alert_interval",
    "alert_for",
}
"""DESIGN's kvctl-agent flags as TOML keys (`--config` itself is not a key)."""
SIZING_KEYS = {"pool_pages", "pool_memory", "gpu_memory_fraction"}


def commented_settings(text: str) -> dict:
    """`# key = value` lines: the optional settings an example shows switched off."""
    lines = re.findall(r"^# ?(\w+ = .+?)(?:[ \t]+#.*)?$", text, flags=re.MULTILINE)
    return tomllib.loads("\n".join(lines))


def validate_with_agent(values: dict) -> None:
    """Check `values` against the agent's own configuration model, where it is installed."""
    try:
        from kvctl.agent.config import AgentConfig
    except ImportError:
        return
    AgentConfig.model_validate(values)


def k8s(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def test_the_example_config_has_every_flag_as_a_key() -> None:
    text = (AGENT / "kvctl-agent.example.toml").read_text()
    active, optional = tomllib.loads(text), commented_settings(text)
    assert set(active) | set(optional) >= FLAG_KEYS  # DESIGN's flags, and maybe more
    assert not set(active) & set(optional)
    assert len(SIZING_KEYS & set(active)) == 1, "exactly one way of sizing the pool"
    validate_with_agent(active)
    validate_with_agent({**active, "alertmanager_url": optional["alertmanager_url"]})


def test_every_yaml_file_parses() -> None:
    files = [*AGENT.rglob("*.yml"), *AGENT.rglob("*.yaml"), *(ROOT / "alerts").glob("*.yml")]
    assert len(files) >= 9
    for path in files:
        documents = list(yaml.safe_load_all(path.read_text()))
        assert documents and all(isinstance(d, dict) for d in documents), path


def test_the_kubernetes_agent_runs_on_gpu_nodes_with_a_token() -> None:
    daemonset = k8s("daemonset.yaml")
    pod = daemonset["spec"]["template"]
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    [container] = spec["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()

    config_text = k8s("configmap.yaml")["data"]["agent.toml"]
    config = tomllib.loads(config_text)
    assert config["host"] == "0.0.0.0" and config["token_file"]
    validate_with_agent(config)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert Path(config["token_file"]).parent == Path(mounts["token"])
    assert volumes["token"]["secret"]["secretName"] == "kvctl-agent-token"
    assert container["args"] == ["--config", f"{mounts['config']}/agent.toml"]


def test_service_and_podmonitor_find_the_agent_pods() -> None:
    pod = k8s("daemonset.yaml")["spec"]["template"]
    labels = pod["metadata"]["labels"]
    port_names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    service, monitor = k8s("service.yaml"), k8s("podmonitor.yaml")
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= port_names
    assert labels[monitor["spec"]["jobLabel"]] == AGENT_JOB  # KvctlAgentDown's job


def test_kustomization_lists_every_manifest() -> None:
    listed = set(k8s("kustomization.yaml")["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_the_scrape_config_uses_the_rule_files_job_and_promtool_accepts_it(tmp_path) -> None:
    config = yaml.safe_load((AGENT / "prometheus-scrape.yml").read_text())
    assert [job["job_name"] for job in config["scrape_configs"]] == [AGENT_JOB]
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed (apt-get install prometheus)")
        pytest.skip("promtool is not installed")
    shutil.copy(AGENT / "prometheus-scrape.yml", tmp_path / "prometheus.yml")
    (tmp_path / "kvctl-rules.yml").write_text(render_rule_file())
    result = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_systemd_unit_starts_the_agent_with_its_config_and_token() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read(AGENT / "kvctl-agent.service")
    service = unit["Service"]
    assert service["ExecStart"].split()[1:] == [
        "--config",
        "/etc/kvctl/agent.toml",
        "--token-file",
        "%d/token",
    ]
    assert service["LoadCredential"] == "token:/etc/kvctl/token"
    assert service["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_the_dockerfile_pins_torch_before_installing_kvctl() -> None:
    text = (AGENT / "Dockerfile").read_text()
    torch = text.index('"torch==${TORCH_VERSION}"')
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    assert torch < text.index("RUN pip install .")
    assert re.search(r"^USER \S+", text, flags=re.MULTILINE)
