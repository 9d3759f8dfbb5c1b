"""The endpoint picker's configuration in docs/gateway.md, checked against a real agent: every
spec of its `kvctl` engine config resolves, the way the picker resolves it, to one series of the
agent's /metrics with a value the picker can use, and the configuration has only keys the picker
accepts (it refuses the whole file over an unknown one)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from agent_process import SMALL_POOL
from prometheus_client.parser import text_string_to_metric_families

from kvctl.api import PoolList, PoolSnapshot

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_DOC = ROOT / "docs" / "gateway.md"
DAEMONSET = ROOT / "agent" / "kubernetes" / "daemonset.yaml"
ENGINE = "kvctl"

# The keys the picker accepts, from llm-d-router commit ebab687927f5331c1b39defcb579a07951bce56c:
# apix/config/v1alpha1/endpointpickerconfig_types.go (the configuration and its parts),
# pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go (core-metrics-extractor) and
# pkg/epp/framework/plugins/datalayer/source/metrics/datasource.go (metrics-data-source). Its
# loader decodes strictly (pkg/epp/framework/interface/plugin/registry.go, StrictDecoder).
API_VERSION = "llm-d.ai/v1alpha1"
CONFIG_KEYS = {
    "apiVersion",
    "kind",
    "featureGates",
    "plugins",
    "schedulingProfiles",
    "dataLayer",
    "flowControl",
    "requestHandler",
    "saturationDetector",
    "parser",
}
PLUGIN_KEYS = {"name", "type", "parameters"}
PROFILE_KEYS = {"name", "plugins"}
PROFILE_PLUGIN_KEYS = {"pluginRef", "weight"}
DATA_LAYER_KEYS = {
    "injectDefaults",
    "sources",
    "discovery",
    "peerDiscovery",
    "crossReplicaSyncerPluginRef",
    "crossReplicaSyncInterval",
}
SOURCE_KEYS = {"pluginRef", "extractors"}
EXTRACTOR_REF_KEYS = {"pluginRef"}
EXTRACTOR_KEYS = {"engineLabelKey", "defaultEngine", "engineConfigs"}
ENGINE_KEYS = {
    "name",
    "queuedRequestsSpec",
    "runningRequestsSpec",
    "kvUsageSpec",
    "loraSpec",
    "cacheInfoSpec",
    "cacheBlockSizeLabelName",
    "cacheNumBlocksLabelName",
    "cacheBlockSizeSpec",
    "cacheNumBlocksSpec",
    "customMetrics",
}
SOURCE_PARAM_KEYS = {
    "scheme",
    "path",
    "port",
    "insecureSkipVerify",
    "caCertPath",
    "clientCertPath",
    "clientKeyPath",
    "interval",
}
# Registered plugin types the doc uses (each file's `...Type = "..."` constant).
PLUGIN_TYPES = {
    "metrics-data-source",
    "core-metrics-extractor",
    "queue-scorer",
    "kv-cache-utilization-scorer",
    "prefix-cache-scorer",
    "max-score-picker",
}
SPEC_FIELDS = (
    "queuedRequestsSpec",
    "runningRequestsSpec",
    "kvUsageSpec",
    "loraSpec",
    "cacheInfoSpec",
    "cacheBlockSizeSpec",
    "cacheNumBlocksSpec",
)
# The InferencePool's fields, from gateway-api-inference-extension api/v1/inferencepool_types.go.
POOL_SPEC_KEYS = {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
PICKER_REF_KEYS = {"group", "kind", "name", "port", "failureMode"}

# The picker's spec syntax (pkg/epp/framework/plugins/datalayer/extractor/metrics/spec.go):
# `name` or `name{label="value",...}`, where a value may be unquoted.
SPEC_RE = re.compile(r"^\s*(\S+?)\s*(?:\{([^}]*)\})?\s*$")
LABEL_RE = re.compile(r'^\s*(\S+?)\s*=\s*"([^"]*)"\s*$')
ADD_QUOTES_RE = re.compile(r'(\w+)\s*=\s*([^",}\s]+)')
METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


# ---- the doc ----------------------------------------------------------------------------------


def yaml_blocks() -> list[Any]:
    text = GATEWAY_DOC.read_text()
    return [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", text, re.S)]


def picker_configs() -> list[dict]:
    """Every block that is a picker configuration or a part of one (a `plugins` list)."""
    return [b for b in yaml_blocks() if isinstance(b, dict) and "plugins" in b]


def full_config() -> dict:
    (config,) = [c for c in picker_configs() if c.get("kind") == "EndpointPickerConfig"]
    return config


def plugin_params(config: dict, plugin_type: str) -> list[dict]:
    return [p.get("parameters") or {} for p in config["plugins"] if p["type"] == plugin_type]


def kvctl_engines(config: dict) -> list[dict]:
    return [
        engine
        for params in plugin_params(config, "core-metrics-extractor")
        for engine in params.get("engineConfigs", [])
        if engine["name"] == ENGINE
    ]


def specs_of(engine: dict) -> dict[str, str]:
    """The engine config's metric specs that are switched on (an empty one is off)."""
    return {f: engine[f] for f in SPEC_FIELDS if engine.get(f)}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """(name, labels) as the picker parses a spec; raises where the picker would refuse it."""
    match = SPEC_RE.match(ADD_QUOTES_RE.sub(r'\1="\2"', spec))
    assert match and METRIC_NAME_RE.fullmatch(match[1]), spec
    labels = {}
    for pair in filter(str.strip, (match[2] or "").split(",")):
        label = LABEL_RE.match(pair)
        assert label, (spec, pair)
        labels[label[1]] = label[2]
    return match[1], labels


# ---- the agent --------------------------------------------------------------------------------


Series = list[tuple[str, dict[str, str], float]]  # (family type, labels, value) per sample


def scrape(http: httpx.Client) -> dict[str, Series]:
    """Every sample of /metrics by its name (the picker looks families up by the exposed name)."""
    response = http.get("/metrics")
    assert response.status_code == 200, response.text
    by_name: dict[str, Series] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            by_name.setdefault(sample.name, []).append((family.type, sample.labels, sample.value))
    return by_name


def resolve(spec: str, metrics: dict[str, Series]) -> list[tuple[str, dict[str, str], float]]:
    """The series a spec matches, in exposition order (the picker takes the first)."""
    name, wanted = parse_spec(spec)
    return [
        (kind, labels, value)
        for kind, labels, value in metrics.get(name, [])
        if all(labels.get(k) == v for k, v in wanted.items())
    ]


def settled(http: httpx.Client) -> PoolList:
    """The pools once no request runs or waits, so /metrics and /v1/pools agree."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        listing = PoolList.model_validate(http.get("/v1/pools").json())
        if all(p.requests_running == 0 and p.requests_waiting == 0 for p in listing.pools):
            time.sleep(0.3)  # one more publication after the last request's end
            return PoolList.model_validate(http.get("/v1/pools").json())
        time.sleep(0.05)
    raise AssertionError("requests still running or waiting after 15 s")


def complete(http: httpx.Client, prompt: str, model: str | None = None) -> None:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    if model is not None:
        body["model"] = model
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


def check_figures(specs: dict[str, str], metrics: dict[str, Series], pool: PoolSnapshot) -> None:
    """Each spec reads exactly the series of `pool`, a gauge (the picker reads only gauges and
    counters) with the value the picker needs."""
    for field, spec in specs.items():
        matched = resolve(spec, metrics)
        assert len(matched) == 1, (field, spec, matched)
        kind, labels, value = matched[0]
        assert kind == "gauge", (spec, kind)
        assert labels["pool"] == pool.pool, (spec, labels)
        if field in ("queuedRequestsSpec", "runningRequestsSpec"):
            assert value >= 0 and value == int(value), (spec, value)
        elif field == "kvUsageSpec":
            assert 0.0 <= value <= 1.0, (spec, value)
            # Pressure: cached prefix pages count as free, as in vLLM's kv_cache_usage_perc.
            assert value == pytest.approx(pool.pressure_ratio), (spec, value)
            if pool.cached_pages:
                assert value < pool.utilization_ratio, (spec, value)
        elif field == "cacheBlockSizeSpec":
            assert value == pool.page_size, (spec, value)
        elif field == "cacheNumBlocksSpec":
            assert value == pool.capacity_pages, (spec, value)
        else:
            raise AssertionError(f"{field}: no expectation for this spec")


# ---- the configuration's shape ----------------------------------------------------------------


def test_the_picker_config_has_only_keys_the_picker_accepts() -> None:
    config = full_config()
    assert config["apiVersion"] == API_VERSION
    assert config.keys() <= CONFIG_KEYS
    for fragment in picker_configs():
        assert fragment.keys() <= CONFIG_KEYS, fragment.keys()
        for plugin in fragment["plugins"]:
            assert plugin.keys() <= PLUGIN_KEYS, plugin
            assert plugin["type"] in PLUGIN_TYPES, plugin["type"]
        for params in plugin_params(fragment, "core-metrics-extractor"):
            assert params.keys() <= EXTRACTOR_KEYS, params
            for engine in params["engineConfigs"]:
                assert engine.keys() <= ENGINE_KEYS, engine
                assert engine["name"] != "default"  # reserved by the picker
                for spec in specs_of(engine).values():
                    parse_spec(spec)
        for params in plugin_params(fragment, "metrics-data-source"):
            assert params.keys() <= SOURCE_PARAM_KEYS, params
    names = {p.get("name") or p["type"] for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert profile.keys() <= PROFILE_KEYS
        for ref in profile["plugins"]:
            assert ref.keys() <= PROFILE_PLUGIN_KEYS and ref["pluginRef"] in names, ref
    assert config["dataLayer"].keys() <= DATA_LAYER_KEYS
    for source in config["dataLayer"]["sources"]:
        assert source.keys() <= SOURCE_KEYS and source["pluginRef"] in names, source
        for extractor in source["extractors"]:
            assert extractor.keys() <= EXTRACTOR_REF_KEYS and extractor["pluginRef"] in names


def test_the_agent_pods_carry_the_engine_label_the_config_names() -> None:
    (extractor,) = plugin_params(full_config(), "core-metrics-extractor")
    pod = yaml.safe_load(DAEMONSET.read_text())["spec"]["template"]
    assert pod["metadata"]["labels"][extractor["engineLabelKey"]] == ENGINE
    assert len(kvctl_engines(full_config())) == 1


def test_the_inference_pool_selects_the_agent_pods_on_their_port() -> None:
    (pool,) = [b for b in yaml_blocks() if isinstance(b, dict) and b.get("kind") == "InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"].keys() <= POOL_SPEC_KEYS
    assert pool["spec"]["endpointPickerRef"].keys() <= PICKER_REF_KEYS
    pod = yaml.safe_load(DAEMONSET.read_text())["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {port["containerPort"] for port in container["ports"]}
    assert {port["number"] for port in pool["spec"]["targetPorts"]} <= ports


# ---- the specs against a real agent -----------------------------------------------------------


@pytest.mark.slow
def test_every_spec_of_the_kvctl_engine_resolves_on_an_agent(start_agent) -> None:
    (engine,) = kvctl_engines(full_config())
    specs = specs_of(engine)
    assert {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"} <= specs.keys()
    agent = start_agent(*SMALL_POOL)
    with httpx.Client(base_url=agent.url, timeout=60) as http:
        for prompt in ("The same system prompt, then one question", "The same system prompt"):
            complete(http, prompt)
        (pool,) = settled(http).pools
        assert pool.cached_pages > 0  # the prefix cache holds pages: pressure < utilisation
        check_figures(specs, scrape(http), pool)


@pytest.mark.slow
def test_pinned_specs_read_their_own_model_on_an_agent_serving_several(start_agent) -> None:
    pinned = [
        engine
        for config in picker_configs()
        for engine in kvctl_engines(config)
        if any("pool" in parse_spec(s)[1] for s in specs_of(engine).values())
    ]
    assert pinned, "docs/gateway.md shows no engine config pinned to a pool"
    models: list[str] = []
    for engine in pinned:
        (model,) = {parse_spec(s)[1].get("pool") for s in specs_of(engine).values()}
        assert model is not None, engine  # every spec of the config pins the same pool
        models.append(model)
    flags = [f for m in models for f in ("--model", f"{m}=demo")]
    # A model configured first, whose series an unpinned spec would read instead.
    flags = ["--model", "first=demo:8x4", *flags]
    agent = start_agent(*flags, "--pool-pages", "64", "--segment-pages", "16", "--page-size", "16")
    with httpx.Client(base_url=agent.url, timeout=60) as http:
        for model in models:
            complete(http, "route me to my own pool", model)
        listing = {p.pool: p for p in settled(http).pools}
        metrics = scrape(http)
        for engine, model in zip(pinned, models, strict=True):
            check_figures(specs_of(engine), metrics, listing[model])
        unpinned = parse_spec(specs_of(pinned[0])["kvUsageSpec"])[0]
        assert resolve(unpinned, metrics)[0][1]["pool"] == "first"
