"""The fixture fleet server: its answers must read as the recorded servers' do, and differ by node.

benchmarks/fleet_prometheus.py and fleet tests stand one server in for hundreds of nodes; a
figure that left its range (a ratio above 1, a counter going back) would show as a kvctl bug
that is not one, and nodes that answered alike would hide a row mixed up with another.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import httpx
import pytest
from exposition_server import (
    FILES,
    FIXTURES,
    KINDS,
    ExpositionServer,
    exposition,
    metrics_path,
    node_url,
    serve,
)
from prometheus_client.parser import text_string_to_metric_families

from kvctl.api import AlertList, ErrorBody, Health, PoolList, PoolSnapshot
from kvctl.client import AsyncAgentClient, NotAnAgent
from kvctl.engines import BY_NAME
from kvctl.exposition import Exposition, detect
from kvctl.fleet import Reading, read_fleet_once, read_node

NODES = (0, 1, 17, 123, 499)
RATIO_NAMES = ("_ratio", "_perc", "usage", "utilization", "hit_rate", "_rate")


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, float]]:
    """Every sample by (name, labels): its family's type and its value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): (family.type, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def recorded(kind: str) -> str:
    return (FIXTURES / FILES[kind]).read_text()


@pytest.fixture(scope="module")
def server() -> Iterator[ExpositionServer]:
    with ExpositionServer().start() as running:
        yield running


@pytest.mark.parametrize("kind", KINDS)
def test_names_types_and_labels_are_the_recorded_ones(kind: str) -> None:
    base = samples(recorded(kind))
    for node in NODES:
        served = samples(exposition(kind, node, 30.0))
        assert served.keys() == base.keys()
        assert {key: t for key, (t, _) in served.items()} == {k: t for k, (t, _) in base.items()}
        assert detect(Exposition.parse(exposition(kind, node, 30.0))) == kind


@pytest.mark.parametrize("kind", KINDS)
def test_values_differ_by_node(kind: str) -> None:
    spec = BY_NAME.get(kind)
    watched = spec.running if spec else "kvctl_requests_running"
    values = {node: samples(exposition(kind, node, 30.0)) for node in range(20)}
    running = {
        next(v for (n, _), (_, v) in values[node].items() if n == watched) for node in values
    }
    assert len(running) >= 3
    assert len({tuple(v for _, v in s.values()) for s in values.values()}) == 20


@pytest.mark.parametrize("kind", KINDS)
def test_ratios_stay_in_range_and_counts_whole(kind: str) -> None:
    base = samples(recorded(kind))
    for node in NODES:
        for key, (family, value) in samples(exposition(kind, node, 600.0)).items():
            name, recorded_value = key[0], base[key][1]
            if math.isnan(recorded_value):
                assert math.isnan(value)
                continue
            assert value >= 0, key
            ratio = name.endswith(RATIO_NAMES)
            if family == "gauge" and ratio and recorded_value <= 1:
                assert value <= 1, key
            elif recorded_value == int(recorded_value) and not name.endswith("_sum"):
                assert value == int(value), key


@pytest.mark.parametrize("kind", KINDS)
def test_counters_grow_and_never_go_back(kind: str) -> None:
    for node in NODES:
        earlier = samples(exposition(kind, node, 10.0))
        later = samples(exposition(kind, node, 70.0))
        growing = [
            key
            for key, (family, _) in earlier.items()
            if family in ("counter", "histogram", "summary") and not key[0].endswith("_created")
        ]
        assert growing
        assert all(later[key][1] > earlier[key][1] for key in growing)
        static = [key for key in earlier if key not in growing]
        assert all(later[k][1] == earlier[k][1] or math.isnan(earlier[k][1]) for k in static)


def test_histogram_buckets_stay_cumulative() -> None:
    for node in NODES:
        for family in text_string_to_metric_families(exposition("vllm", node, 300.0)):
            if family.type != "histogram":
                continue
            series: dict[tuple, list[float]] = {}
            counts: dict[tuple, float] = {}
            for s in family.samples:
                rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                if s.name.endswith("_bucket"):
                    series.setdefault(rest, []).append(s.value)
                elif s.name.endswith("_count"):
                    counts[rest] = s.value
            for rest, buckets in series.items():
                assert buckets == sorted(buckets), family.name
                assert buckets[-1] == counts[rest], family.name


def test_http_paths_and_params_give_the_same_exposition(server: ExpositionServer) -> None:
    with httpx.Client(base_url=server.url) as http:
        for kind in KINDS:
            by_path = http.get(metrics_path(42, kind))
            by_param = http.get("/metrics", params={"node": 42, "kind": kind})
            assert by_path.status_code == by_param.status_code == 200
            assert by_path.headers["content-type"].startswith("text/plain")
            assert samples(by_path.text).keys() == samples(by_param.text).keys()
        assert http.get("/node/42/trtllm/metrics").json() == []  # trtllm-serve's JSON there
        assert http.get("/node/42/vllm/healthz").status_code == 404
        assert http.get("/node/42/nope/metrics").status_code == 404


def test_agent_api_answers_validate_as_kvctl_models(server: ExpositionServer) -> None:
    with httpx.Client(base_url=node_url(server.url, 17, "kvctl")) as http:
        health = Health.model_validate_json(http.get("healthz").content)
        pools = PoolList.model_validate_json(http.get("v1/pools").content)
        pool = PoolSnapshot.model_validate_json(http.get("v1/pool").content)
        AlertList.model_validate_json(http.get("v1/alerts").content)
        missing = http.get("v1/nope")
    assert health.pools == [pool.pool] == [p.pool for p in pools.pools]
    assert 0 <= pool.pressure_ratio <= pool.utilization_ratio <= 1
    assert missing.status_code == 404
    assert ErrorBody.model_validate_json(missing.content).error.type == "not_found"


def test_agent_pools_differ_by_node_and_alerts_follow_pressure(server: ExpositionServer) -> None:
    with httpx.Client(base_url=server.url) as http:
        pools = {
            node: PoolList.model_validate_json(http.get(f"/node/{node}/kvctl/v1/pools").content)
            for node in range(40)
        }
        alerts = {
            node: AlertList.model_validate_json(http.get(f"/node/{node}/kvctl/v1/alerts").content)
            for node in range(40)
        }
    assert len({p.pools[0].used_pages for p in pools.values()}) > 20
    for node, listing in pools.items():
        pool = listing.pools[0]
        assert 0 <= pool.fragmentation_ratio <= 1 and 0 <= pool.prefix_hit_ratio <= 1
        assert bool(alerts[node].alerts) == (pool.pressure_ratio > 0.9)


def test_kvctl_reads_nodes_at_base_urls_with_a_path() -> None:
    """`kvctl status -a http://host:port/node/17/kvctl`: the path is kept before every route."""
    with serve() as base:
        urls = [node_url(base, 17, "kvctl"), f"vllm+{node_url(base, 18, 'vllm')}"]
        agent, engine = read_fleet_once(urls)
    assert agent.up and agent.engine == "kvctl" and agent.pool is not None
    assert engine.up and engine.engine == "vllm" and engine.model == "smollm"


def test_engines_are_recognised_where_each_serves_its_text(server: ExpositionServer) -> None:
    async def read(url: str) -> Reading:
        async with AsyncAgentClient(url) as client:
            return await read_node(client)

    for node, kind in ((3, "sglang"), (4, "trtllm"), (5, "vllm")):
        reading = asyncio.run(read(node_url(server.url, node, kind)))
        assert reading.up and reading.engine == kind, reading.error
    assert isinstance(asyncio.run(read(f"{server.url}/node/6/unknown")).error, NotAnAgent)
