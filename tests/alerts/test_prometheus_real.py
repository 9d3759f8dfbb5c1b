"""The generated rule file in a real Prometheus that scrapes a scripted exporter and alerts a real
Alertmanager: the rules load without errors, the recording rules return values, and an alert
arrives with its remediation and resolves when the metric recovers.

The exporter serves the agent's metric names with values the test sets, so this checks the
rule file against Prometheus itself, independent of the agent process.
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

    def __init__(self) -> None:
        self.gauges = {
            "kvctl_pool_capacity_pages": 512,
            "kvctl_pool_used_pages": 200,
            "kvctl_pool_cached_pages": 112,
            "kvctl_pool_free_pages": 200,
            "kvctl_pool_utilization_ratio": 0.61,
            "kvctl_pool_fragmentation_ratio": 0.8,
            "kvctl_pool_free_extents": 40,
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
            "kvctl_prefix_cache_hits_tokens_total": 50 * n,
            "kvctl_preemptions_total": 0,
            "kvctl_defrag_pages_moved_total": 0,
        }
        for name, value in counters.items():
            lines += [f"# TYPE {name} counter", f'{name}{{pool="demo"}} {value}']
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
def exporter() -> Iterator[ScriptedExporter]:
    exporter = ScriptedExporter()
    thread = threading.Thread(target=exporter.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield exporter
    finally:
        exporter.server.shutdown()
        exporter.server.server_close()


def active(stack, name: str) -> list[dict]:
    return [a for a in stack.am_alerts(active="true") if a["labels"]["alertname"] == name]


def test_rules_load_record_and_alert_through_alertmanager(prom_stack, exporter) -> None:
    prom_stack.start_alertmanager()
    rules = render_rule_file(api.AlertSettings(for_s=1))
    prom_stack.start_prometheus([exporter.target], rules)

    def evaluated_rules() -> list[dict]:
        rules = [r for g in prom_stack.rule_groups() for r in g["rules"]]
        done = rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules)
        return rules if done else []

    loaded = prom_stack.wait_for(evaluated_rules, "every rule to be evaluated")
    assert len(loaded) == 15
    assert [(r["name"], r["health"]) for r in loaded if r["health"] != "ok"] == []

    def recorded(name: str) -> float | None:
        result = prom_stack.query(name)
        return float(result[0]["value"][1]) if result else None

    prom_stack.wait_for(lambda: recorded("kvctl:alloc_success:ratio_rate5m"), "the success ratio")
    assert recorded("kvctl:alloc_success:ratio_rate5m") == 1.0
    assert recorded("kvctl:prefix_hit:ratio_rate5m") == pytest.approx(0.5)

    [alert] = prom_stack.wait_for(
        lambda: active(prom_stack, "KvctlFragmentationHigh"), "the alert in Alertmanager"
    )
    assert alert["labels"] == {
        "alertname": "KvctlFragmentationHigh",
        "severity": "warning",
        "pool": "demo",
        "instance": exporter.target,
        "job": "kvctl-agent",
    }
    annotations = alert["annotations"]
    assert annotations["description"].startswith(
        "fragmentation 0.80 with 200 free pages in 40 extents; "
    )
    assert f"`kvctl --agent http://{exporter.target} defrag --now`" in annotations["remediation"]
    assert annotations["runbook_url"] == "docs/alerts.md#kvctlfragmentationhigh"

    exporter.gauges["kvctl_pool_fragmentation_ratio"] = 0.05  # defragmented
    prom_stack.wait_for(
        lambda: not active(prom_stack, "KvctlFragmentationHigh"), "the alert to resolve"
    )
