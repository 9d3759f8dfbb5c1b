"""The deployment artefacts under agent/ parse and agree with each other: the example config
has every flag as a key, the Kubernetes objects select each other and bind publicly only with a
token, Prometheus scrapes with that token, and a node's alerts have one identity: the scrape job
is the one the rule file expects and the agents put on their alerts, and the address Prometheus
scrapes is the one the agent advertises."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from local_tools import find_binary

from kvctl.agent.config import AgentConfig
from kvctl.agent.http.connections import RESERVED_FILES, UNLIMITED_PATHS
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
"""The documented kvctl-agent flags as TOML keys (`--config` itself is not a key)."""
SIZING_KEYS = {"pool_pages", "pool_memory", "gpu_memory_fraction"}


def commented_settings(text: str) -> dict:
    """`# key = value` lines: the optional settings an example shows switched off."""
    lines = re.findall(r"^# ?(\w+ = .+?)(?:[ \t]+#.*)?$", text, flags=re.MULTILINE)
    return tomllib.loads("\n".join(lines))


def validate_with_agent(values: dict, tmp_path: Path, **flags: object) -> object:
    """`values` (and `flags`) read by the agent's own configuration loader, where the agent is
    installed: the loaded configuration, or None. A token file is replaced by a readable one."""
    try:
        from kvctl.agent.config import load_config
    except ImportError:
        return None
    values = dict(values)
    if "token_file" in values:
        token = tmp_path / "token"
        token.write_text("s3cret")
        values["token_file"] = str(token)
    config_file = tmp_path / "agent.toml"
    config_file.write_text(_toml(values))
    return load_config(flags, config_file)


def _toml(values: dict) -> str:
    """TOML of flat keys and `[section]` tables of strings, numbers and booleans (all the
    examples hold)."""
    flat = [f"{key} = {_toml_value(v)}" for key, v in values.items() if not isinstance(v, dict)]
    tables = [
        f"[{name}]\n" + "".join(f"{key} = {_toml_value(v)}\n" for key, v in table.items())
        for name, table in values.items()
        if isinstance(table, dict)
    ]
    return "\n".join(flat) + "\n" + "".join(tables)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(str(value))


def k8s(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def test_the_example_config_has_every_flag_as_a_key(tmp_path) -> None:
    text = (AGENT / "kvctl-agent.example.toml").read_text()
    active, optional = tomllib.loads(text), commented_settings(text)
    assert set(active) | set(optional) >= FLAG_KEYS  # the documented flags, and maybe more
    assert not set(active) & set(optional)
    assert len(SIZING_KEYS & set(active)) == 1, "exactly one way of sizing the pool"
    validate_with_agent(active, tmp_path)
    validate_with_agent({**active, "alertmanager_url": optional["alertmanager_url"]}, tmp_path)


def test_every_yaml_file_parses() -> None:
    files = [*AGENT.rglob("*.yml"), *AGENT.rglob("*.yaml"), *(ROOT / "alerts").glob("*.yml")]
    assert len(files) >= 9
    for path in files:
        documents = list(yaml.safe_load_all(path.read_text()))
        assert documents and all(isinstance(d, dict) for d in documents), path


def test_the_kubernetes_agent_runs_on_gpu_nodes_with_a_token(tmp_path) -> None:
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
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert Path(config["token_file"]).parent == Path(mounts["token"])
    assert volumes["token"]["secret"]["secretName"] == "kvctl-agent-token"
    assert container["args"][:2] == ["--config", f"{mounts['config']}/agent.toml"]
    loaded = validate_with_agent(config, tmp_path, advertise_url=pod_advertise_url(container))
    if loaded is not None:
        assert loaded.advertised(8477) == "http://10.1.2.3:8477"
        assert loaded.prometheus_job == AGENT_JOB


def pod_advertise_url(container: dict) -> str:
    """The container's --advertise-url with the downward-API variables a pod would get."""
    args = container["args"]
    url = args[args.index("--advertise-url") + 1]
    env = {e["name"]: e for e in container["env"]}
    for name in re.findall(r"\$\((\w+)\)", url):
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", name
        url = url.replace(f"$({name})", "10.1.2.3")
    return url


def test_the_agent_advertises_the_address_the_podmonitor_scrapes() -> None:
    """`instance` on a pushed alert is the advertised host:port; on a scraped series it is the
    pod's IP and the endpoint's port. They must be the same for one identity per node."""
    [container] = k8s("daemonset.yaml")["spec"]["template"]["spec"]["containers"]
    url = urlsplit(pod_advertise_url(container))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    [endpoint] = k8s("podmonitor.yaml")["spec"]["podMetricsEndpoints"]
    assert (url.hostname, url.port) == ("10.1.2.3", ports[endpoint["port"]])
    config = tomllib.loads(k8s("configmap.yaml")["data"]["agent.toml"])
    assert config["port"] == url.port


def test_prometheus_scrapes_the_agents_with_their_token() -> None:
    spec = k8s("daemonset.yaml")["spec"]["template"]["spec"]
    token_secret = {v["name"]: v for v in spec["volumes"]}["token"]["secret"]["secretName"]
    token_file = Path(tomllib.loads(k8s("configmap.yaml")["data"]["agent.toml"])["token_file"])
    [endpoint] = k8s("podmonitor.yaml")["spec"]["podMetricsEndpoints"]
    authorization = endpoint["authorization"]
    assert authorization["type"] == "Bearer"
    assert authorization["credentials"] == {"name": token_secret, "key": token_file.name}
    scrape = yaml.safe_load((AGENT / "prometheus-scrape.yml").read_text())
    [job] = scrape["scrape_configs"]
    assert job["authorization"]["type"] == "Bearer"
    assert job["authorization"]["credentials_file"]


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


def test_the_commented_inference_pool_is_the_documented_one_and_selects_the_agent_pods() -> None:
    """The InferencePool example at the end of daemonset.yaml, uncommented, is the one in
    docs/gateway.md and selects the agent pods on their port; the pods carry the engine label
    whose engine config the picker applies to them."""
    text = (K8S / "daemonset.yaml").read_text()
    example = text[text.index("# ---\n") :]
    commented = "\n".join(re.sub(r"^# ?", "", line) for line in example.splitlines())
    [pool] = [d for d in yaml.safe_load_all(commented) if d]
    doc = (ROOT / "docs" / "gateway.md").read_text()
    documented = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", doc, re.S)]
    assert pool in documented
    assert pool["kind"] == "InferencePool"
    pod = k8s("daemonset.yaml")["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= ports
    assert pod["metadata"]["labels"]["llm-d.ai/engine-type"] == "kvctl"


def test_kustomization_lists_every_manifest() -> None:
    listed = set(k8s("kustomization.yaml")["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_the_scrape_config_uses_the_rule_files_job_and_promtool_accepts_it(tmp_path) -> None:
    config = yaml.safe_load((AGENT / "prometheus-scrape.yml").read_text())
    assert [job["job_name"] for job in config["scrape_configs"]] == [AGENT_JOB]
    promtool = find_binary("promtool")
    shutil.copy(AGENT / "prometheus-scrape.yml", tmp_path / "prometheus.yml")
    (tmp_path / "kvctl-rules.yml").write_text(render_rule_file())
    [job] = config["scrape_configs"]
    (tmp_path / job["authorization"]["credentials_file"]).write_text("s3cret")
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
    # room for the default 2,048 connections, the accept backlog and the agent's own files
    assert int(service["LimitNOFILE"]) >= 2 * AgentConfig().max_connections + RESERVED_FILES


def test_the_kubernetes_probes_ask_healthz_with_timeouts_and_wait_for_start_up() -> None:
    daemonset = yaml.safe_load((K8S / "daemonset.yaml").read_text())
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]
        assert check["httpGet"]["path"] in UNLIMITED_PATHS, probe
        assert 0 < check["timeoutSeconds"] < check["periodSeconds"] + 1, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # a slow checkpoint


def test_the_dockerfile_pins_torch_before_installing_kvctl() -> None:
    text = (AGENT / "Dockerfile").read_text()
    torch = text.index('"torch==${TORCH_VERSION}"')
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    assert torch < text.index("RUN pip install .")
    assert re.search(r"^USER \S+", text, flags=re.MULTILINE)
