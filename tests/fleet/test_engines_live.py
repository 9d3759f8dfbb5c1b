"""Engines and agents read over real HTTP, and the fleet read from a real Prometheus.

The engines are tests/exposition_server.py: one real HTTP server answering as many nodes, each
with an exposition recorded from (or built from the source of) that engine. The kvctl agent of
the Prometheus test is a real agent process, so the queries are checked against the names it
really exports.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from exposition_server import ExpositionServer, node_url
from local_tools import free_port
from prom_stack import PromStack

from kvctl.cli.options import ExitCode

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def nodes() -> ExpositionServer:
    server = ExpositionServer().start()
    yield server
    server.stop()


def entries(result) -> dict[str, list[dict]]:
    """`status --json` entries by agent URL."""
    out: dict[str, list[dict]] = {}
    for entry in json.loads(result.stdout)["agents"]:
        out.setdefault(entry["agent"], []).append(entry)
    return out


def test_engines_are_found_from_their_metrics_beside_an_agent(kvctl, nodes) -> None:
    urls = {kind: node_url(nodes.url, 3, kind) for kind in ("kvctl", "vllm", "trtllm")}
    sglang = node_url(nodes.url, 4, "sglang")
    result = kvctl(*(f"-a{url}" for url in urls.values()), f"-asglang+{sglang}", "status", "--json")
    assert result.exit_code == 0, result.output
    found = entries(result)
    assert [e["engine"] for e in found[urls["kvctl"]]] == ["kvctl"]
    assert found[urls["kvctl"]][0]["source"] == "agent"  # its API, so its page map and actions
    for kind in ("vllm", "trtllm"):
        (entry,) = found[urls[kind]]
        assert (entry["engine"], entry["source"], entry["up"]) == (kind, "metrics", True)
        figures = entry["figures"]
        assert 0 <= figures["utilization_ratio"] <= 1 and figures["capacity_tokens"] > 0
        assert figures["fragmentation_ratio"] is None and figures["alloc_success_ratio"] is None
        assert entry["notes"]  # its pitfalls
    assert found[sglang][0]["engine"] == "sglang"
    assert found[urls["trtllm"]][0]["figures"]["preemptions"] is None  # it exports none


def test_a_named_engine_that_is_another_is_a_down_row_saying_so(kvctl, nodes) -> None:
    url = node_url(nodes.url, 1, "vllm")
    result = kvctl("-a", f"sglang+{url}", "status")
    assert result.exit_code == ExitCode.UNREACHABLE
    assert (
        result.stderr.strip()
        == f"kvctl: {url}/metrics has no sglang:max_total_num_tokens; is it SGLang?"
    )


def test_a_url_that_is_neither_agent_nor_engine_is_one_line(kvctl, nodes) -> None:
    result = kvctl("-a", f"{nodes.url}/nothing", "status")
    assert result.exit_code == ExitCode.UNREACHABLE
    (line,) = result.stderr.strip().splitlines()
    assert "not as a kvctl agent (404 Not Found); check --agent URL" in line
    assert line.endswith("nor is it an engine kvctl reads (vLLM, SGLang, TensorRT-LLM)")


def test_commands_that_act_refuse_an_engine(kvctl, nodes) -> None:
    url = f"vllm+{node_url(nodes.url, 1, 'vllm')}"
    result = kvctl("-a", url, "defrag", "--now", "--yes")
    assert result.exit_code == ExitCode.USAGE
    assert "vLLM is read by `kvctl status` and `kvctl top` only" in result.stderr


# ---- the fleet from Prometheus ----------------------------------------------------------------


def scrape_configs(server: ExpositionServer, agent: str, down: int) -> list[dict]:
    """Jobs as a fleet would have them: each engine's nodes, a real agent, a target that is
    down."""
    host = server.url.removeprefix("http://")

    def nodes(kind: str, numbers: range) -> list[dict]:
        return [
            {"targets": [host], "labels": {"instance": f"{kind}-{n}:8000", "__param_node": str(n),
                                           "__param_kind": kind}}
            for n in numbers
        ]  # fmt: skip

    return [
        {"job_name": "vllm", "static_configs": nodes("vllm", range(1, 4))},
        {"job_name": "trtllm", "metrics_path": "/prometheus/metrics",
         "static_configs": nodes("trtllm", range(1, 2))},
        {"job_name": "kvctl-agent", "static_configs": [{"targets": [agent, f"127.0.0.1:{down}"]}]},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, nodes: ExpositionServer) -> tuple[PromStack, str, str]:
    """A Prometheus scraping three vLLM nodes, a TensorRT-LLM node, a real agent and a target
    that is down, once every target was scraped three times (rates need two samples)."""
    from agent_process import SMALL_POOL, launch_agent

    agent = launch_agent(*SMALL_POOL)
    stack = PromStack(workdir=tmp_path_factory.mktemp("prometheus"))
    down = free_port()
    host = agent.url.removeprefix("http://")
    try:
        stack.start_prometheus([], "groups: []\n", scrape_configs=scrape_configs(nodes, host, down))
        httpx.post(f"{agent.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            counts = stack.query("count_over_time(up[1m])")
            if len(counts) == 6 and min(float(c["value"][1]) for c in counts) >= 3:
                break
            time.sleep(0.5)
        yield stack, agent.url, f"127.0.0.1:{down}"
    finally:
        stack.stop()
        agent.stop()


def test_the_fleet_from_prometheus_has_every_node_with_its_engines_figures(
    kvctl, prometheus
) -> None:
    stack, agent_url, down = prometheus
    result = kvctl("status", "--prometheus", stack.prometheus_url, "--json")
    assert result.exit_code == ExitCode.UNREACHABLE  # one target is down
    found = entries(result)
    assert sorted(found) == sorted(
        [agent_url, f"http://{down}", *(f"http://vllm-{n}:8000" for n in (1, 2, 3)),
         "http://trtllm-1:8000"]
    )  # fmt: skip
    (row,) = found[agent_url]
    pool = httpx.get(f"{agent_url}/v1/pool").json()
    figures = row["figures"]
    assert (row["engine"], row["source"], row["model"]) == ("kvctl", "prometheus", pool["pool"])
    assert figures["capacity_tokens"] == pool["capacity_pages"] * pool["page_size"]
    assert figures["capacity_bytes"] == pool["capacity_bytes"]  # as its API says
    assert figures["fragmentation_ratio"] == pytest.approx(pool["fragmentation_ratio"])
    for n in (1, 2, 3):
        (vllm,) = found[f"http://vllm-{n}:8000"]
        assert vllm["engine"] == "vllm" and vllm["model"] == "smollm"
        assert 0 < vllm["figures"]["prefix_hit_ratio"] <= 1  # its counters grow: a 5m rate
        assert vllm["figures"]["capacity_tokens"] == 1280  # blocks × block size, info labels
    utilisations = {
        found[f"http://vllm-{n}:8000"][0]["figures"]["utilization_ratio"] for n in (1, 2, 3)
    }
    assert len(utilisations) == 3  # each node its own figure
    assert found["http://trtllm-1:8000"][0]["figures"]["capacity_tokens"] > 0
    (gone,) = found[f"http://{down}"]
    assert not gone["up"] and "up == 0" in gone["error"]


def test_a_selector_narrows_every_query(kvctl, prometheus) -> None:
    stack, _, _ = prometheus
    only_vllm = ("--prometheus", stack.prometheus_url, "--selector", '{job="vllm"}')
    result = kvctl("status", *only_vllm, "--json")
    assert result.exit_code == 0, result.output
    assert {e["engine"] for rows in entries(result).values() for e in rows} == {"vllm"}
    table = kvctl("status", *only_vllm)
    assert table.stdout.count("vLLM smollm") == 3
    assert "preempt 5m" in table.stdout.splitlines()[0]  # not the count since start


def test_a_selector_prometheus_refuses_is_a_usage_error(kvctl, prometheus) -> None:
    stack, _, _ = prometheus
    result = kvctl("status", "--prometheus", stack.prometheus_url, "--selector", '{job=~"("}')
    assert result.exit_code == ExitCode.USAGE
    assert len(result.stderr.strip().splitlines()) == 1 and "answered 400" in result.stderr


def test_an_unreachable_prometheus_is_one_line(kvctl) -> None:
    result = kvctl("status", "--prometheus", f"http://127.0.0.1:{free_port()}")
    assert result.exit_code == ExitCode.UNREACHABLE
    assert result.stderr.startswith("kvctl: cannot reach Prometheus at")


def test_a_node_found_to_be_an_engine_is_read_from_its_metrics_alone_from_then_on(nodes) -> None:
    """`kvctl top` polls every second: asking a vLLM node the agent API each time was three
    404s per poll before its /metrics."""
    import asyncio

    from kvctl.fleet import Fleet

    url = node_url(nodes.url, 7, "vllm")

    node = url.removeprefix(nodes.url)

    async def two_reads() -> tuple[list[str], list[str]]:
        fleet = Fleet([url])
        try:
            before = len(nodes.paths)
            (first,) = await fleet.read()
            middle = len(nodes.paths)
            (second,) = await fleet.read()
            assert first.engine == second.engine == "vllm" and second.up
            return nodes.paths[before:middle], nodes.paths[middle:]
        finally:
            await fleet.aclose()

    first, second = asyncio.run(two_reads())
    assert f"{node}/healthz" in first  # the agent API was tried first
    assert [p for p in second if p.startswith(node)] == [f"{node}/metrics"]
