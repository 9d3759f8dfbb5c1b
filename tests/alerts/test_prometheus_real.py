"""The generated rule file in a real Prometheus that scrapes scripted exporters and alerts a real
Alertmanager: the rules load without errors, the recording rules return values (the prefix hit
ratio summed over the tiers its hits come from, each tier's reuse and load cost), and the fleet
alert, which needs several agents, arrives with its texts and resolves when the fleet recovers.

Each exporter serves the agent's metric names with values the test sets (three "nodes" serving
one model), so this checks the rule file against Prometheus itself, independent of the agent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvctl import api
from kvctl.alerts import render_rule_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class ScriptedExporter:
    """Serves kvctl_* series for pool "demo"; counters advance on every scrape."""

    def __init__(self, pressure: float) -> None:
        self.gauges = {
            "kvctl_pool_capacity_pages": 512,
            "kvctl_pool_used_pages": round(512 * pressure),
            "kvctl_pool_utilization_ratio": 0.98,
            "kvctl_pool_pressure_ratio": pressure,
            "kvctl_requests_waiting": 0,
        }
        self.scrapes = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def exposition(self) -> str:
        self.scrapes += 1
        n = self.scrapes
        lines = [f'{name}{{pool="demo"}} {value}' for name, value in self.gauges.items()]
        counters = {
            "kvctl_alloc_attempts_total": 10 * n,
            "kvctl_alloc_failures_total": 0,
            "kvctl_prefix_cache_queries_tokens_total": 100 * n,
            "kvctl_preemptions_total": 0,
            "kvctl_defrag_pages_moved_total": 0,
        }
        for name, value in counters.items():
            lines += [f"# TYPE {name} counter", f'{name}{{pool="demo"}} {value}']
        # half the tokens hit: 30 on the device and 20 loaded from the host tier, which loads
        # 1 page for every 8 it stores, at 2 ms a token
        tiered = {
            "kvctl_prefix_cache_hits_tokens_total": {"device": 30 * n, "host": 20 * n},
            "kvctl_kv_tier_stored_pages_total": {"host": 8 * n},
            "kvctl_kv_tier_loaded_pages_total": {"host": n},
            "kvctl_kv_tier_load_seconds_total": {"host": 0.04 * n},
        }
        for name, values in tiered.items():
            lines.append(f"# TYPE {name} counter")
            lines += [f'{name}{{pool="demo",tier="{t}"}} {v}' for t, v in values.items()]
        lines += [
            "# TYPE kvctl_defrag_duration_seconds histogram",
            'kvctl_defrag_duration_seconds_bucket{pool="demo",le="+Inf"} 0',
            'kvctl_defrag_duration_seconds_sum{pool="demo"} 0',
            'kvctl_defrag_duration_seconds_count{pool="demo"} 0',
        ]
        return "\n".join(lines) + "\n"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = exporter.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def fleet() -> Iterator[list[ScriptedExporter]]:
    """Three nodes serving pool "demo": two under pressure, one with room."""
    exporters = [ScriptedExporter(0.97), ScriptedExporter(0.99), ScriptedExporter(0.5)]
    for exporter in exporters:
        threading.Thread(target=exporter.server.serve_forever, daemon=True).start()
    try:
        yield exporters
    finally:
        for exporter in exporters:
            exporter.server.shutdown()
            exporter.server.server_close()


def active(stack, name: str) -> list[dict]:
    return [a for a in stack.am_alerts(active="true") if a["labels"]["alertname"] == name]


def test_rules_load_record_and_raise_the_fleet_alert(prom_stack, fleet) -> None:
    prom_stack.start_alertmanager()
    rules = render_rule_file(api.AlertSettings(for_s=1))  # the fleet alert holds 5 s
    prom_stack.start_prometheus([e.target for e in fleet], rules)

    def evaluated_rules() -> list[dict]:
        rules = [r for g in prom_stack.rule_groups() for r in g["rules"]]
        done = rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules)
        return rules if done else []

    loaded = prom_stack.wait_for(evaluated_rules, "every rule to be evaluated")
    assert len(loaded) == 11
    assert [(r["name"], r["health"]) for r in loaded if r["health"] != "ok"] == []

    def recorded(name: str) -> list[float]:
        return [float(r["value"][1]) for r in prom_stack.query(name)]

    ratios = (
        "kvctl:alloc_success:ratio_rate5m",
        "kvctl:prefix_hit:ratio_rate5m",
        "kvctl:tier_reuse:ratio_rate5m",
        "kvctl:tier_load_seconds_per_token:rate5m",
    )
    prom_stack.wait_for(
        lambda: all(len(recorded(name)) == len(fleet) for name in ratios), "every node's ratios"
    )
    assert recorded("kvctl:alloc_success:ratio_rate5m") == [1.0, 1.0, 1.0]
    assert recorded("kvctl:prefix_hit:ratio_rate5m") == pytest.approx([0.5, 0.5, 0.5])
    assert recorded("kvctl:tier_reuse:ratio_rate5m") == pytest.approx([0.125] * 3)
    assert recorded("kvctl:tier_load_seconds_per_token:rate5m") == pytest.approx([0.002] * 3)

    [alert] = prom_stack.wait_for(
        lambda: active(prom_stack, "KvctlFleetPressureHigh"), "the fleet alert in Alertmanager"
    )
    assert alert["labels"] == {
        "alertname": "KvctlFleetPressureHigh",
        "severity": "warning",
        "pool": "demo",
        "job": "kvctl-agent",
    }
    assert alert["annotations"]["description"].startswith(
        "running requests hold more than 95% of the pool on 66.67% of the agents of job "
        "kvctl-agent serving demo: "
    )
    assert alert["annotations"]["runbook_url"] == (
        "https://kvctl-runbook.invalid/alerts#kvctlfleetpressurehigh"
    )
    assert not active(prom_stack, "KvctlAgentDown") and not active(prom_stack, "KvctlAgentAbsent")

    fleet[0].gauges["kvctl_pool_pressure_ratio"] = 0.6  # one node got room: a third now
    prom_stack.wait_for(
        lambda: not active(prom_stack, "KvctlFleetPressureHigh"), "the fleet alert to resolve"
    )
