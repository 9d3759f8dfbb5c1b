"""`kvctl alerts rules` and `kvctl alerts test`: sent through an agent (its own route, labels and
token) or posted directly, to a stand-in Alertmanager on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import yaml
from agent_process import SMALL_POOL

from kvctl.alerts import render_rule_file
from kvctl.api import AlertSettings

TOKEN = "alert-test-s3cret"


class _Receiver(BaseHTTPRequestHandler):
    posts: ClassVar[list[tuple[str, object]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Receiver.posts.append((self.path, json.loads(body)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        """Quiet."""


@pytest.fixture
def alertmanager() -> Iterator[tuple[str, list]]:
    """A loopback HTTP server that records what is posted to it."""
    _Receiver.posts = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Receiver.posts
    server.shutdown()
    server.server_close()


def test_rules_print_the_rule_file(kvctl) -> None:
    result = kvctl("alerts", "rules")
    assert result.exit_code == 0
    assert result.stdout == render_rule_file()
    as_json = json.loads(kvctl("alerts", "rules", "--json").stdout)
    assert as_json == yaml.safe_load(render_rule_file())
    assert as_json["groups"][0]["rules"]


def test_test_alert_reaches_alertmanager(kvctl, alertmanager) -> None:
    url, posts = alertmanager
    result = kvctl("alerts", "test", "--alertmanager-url", url, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"alertmanager_url", "sent", "alert"}
    assert (data["alertmanager_url"], data["sent"]) == (url, True)
    ((path, body),) = posts
    assert path == "/api/v2/alerts"
    assert body == [data["alert"]]
    human = kvctl("alerts", "test", "--alertmanager-url", url)
    assert human.stdout.startswith(f"test alert sent to {url} (")


def test_test_alert_without_alertmanager_is_one_line(kvctl) -> None:
    result = kvctl("alerts", "test", "--alertmanager-url", "http://127.0.0.1:9")
    assert result.exit_code == 1
    assert result.stderr.startswith("kvctl: cannot reach Alertmanager at http://127.0.0.1:9")
    assert len(result.stderr.splitlines()) == 1
    assert ".;" not in result.stderr and result.stderr.rstrip().endswith("that it listens")


def test_an_alertmanager_url_that_is_no_url_is_a_usage_error(kvctl) -> None:
    result = kvctl("alerts", "test", env={"KVCTL_ALERTMANAGER_URL": "bogus"})
    assert result.exit_code == 2
    assert result.stderr == (
        "kvctl: --alertmanager-url 'bogus' is not an Alertmanager URL; "
        "give one such as http://localhost:9093\n"
    )
    listed = kvctl("alerts", "list", "--from-am", "localhost:9093")
    assert listed.exit_code == 2 and "--from-am 'localhost:9093'" in listed.stderr


def test_rules_take_a_runbook_base_and_a_job(kvctl) -> None:
    base = "http://gpu-node-1:8477/runbook"
    result = kvctl("alerts", "rules", "--runbook-url", base, "--job", "llm-kv")
    assert result.exit_code == 0, result.output
    assert result.stdout == render_rule_file(runbook_base=base, job="llm-kv")
    assert f"runbook_url: {base}#kvctlagentdown" in result.stdout
    assert 'up{job="llm-kv"} == 0' in result.stdout


def test_rules_refuse_a_relative_runbook_base(kvctl) -> None:
    result = kvctl("alerts", "rules", "--runbook-url", "docs/alerts.md")
    assert result.exit_code == 2
    assert result.stderr.startswith("kvctl: --runbook-url must be an absolute http(s) URL")
    assert len(result.stderr.splitlines()) == 1 and result.stdout == ""


def test_the_agent_sends_the_test_alert_with_its_labels_and_token(
    kvctl, alertmanager, start_agent
) -> None:
    url, posts = alertmanager
    agent = start_agent(*SMALL_POOL, "--alertmanager-url", url, token=TOKEN)
    instance = agent.url.removeprefix("http://")

    refused = kvctl("--agent", agent.url, "alerts", "test")
    assert refused.exit_code == 4 and posts == []  # the route needs the token: nothing sent

    result = kvctl("--agent", agent.url, "--token", TOKEN, "--json", "alerts", "test")
    assert result.exit_code == 0, result.output
    sent = json.loads(result.stdout)
    ((path, body),) = posts
    assert path == "/api/v2/alerts" and body == [sent["alert"]]
    assert sent["alert"]["labels"] == {
        "alertname": "KvctlTestAlert",
        "severity": "info",
        "pool": "demo",
        "instance": instance,
        "job": "kvctl-agent",
    }
    assert sent["alert"]["annotations"]["runbook_url"] == f"{agent.url}/runbook#kvctltestalert"
    human = kvctl("--agent", agent.url, "--token", TOKEN, "alerts", "test")
    assert human.stdout.startswith("test alert sent to the agent's Alertmanager (")


def test_an_agent_without_alertmanager_says_how_to_fix_it(kvctl, agent) -> None:
    result = kvctl("--agent", agent.url, "alerts", "test")
    assert result.exit_code == 1
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"kvctl: agent {agent.url}: ")
    assert "start it with --alertmanager-url" in result.stderr


def test_rules_follow_the_alert_settings_the_agents_use(kvctl) -> None:
    result = kvctl(
        "alerts", "rules", "--set", "alerts.pressure_high=0.9", "--set", "alerts.for_s=2m"
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == render_rule_file(AlertSettings(pressure_high=0.9, for_s=120))
    refused = kvctl("alerts", "rules", "--set", "alerts.pressure_high=2")
    assert refused.exit_code == 2
    assert (
        refused.stderr == "kvctl: --set alerts.pressure_high: must be a number in [0, 1], got 2.0\n"
    )
    wrong = kvctl("alerts", "rules", "--set", "defrag.enabled=false")
    assert wrong.exit_code == 2 and "write --set alerts.NAME=VALUE" in wrong.stderr
