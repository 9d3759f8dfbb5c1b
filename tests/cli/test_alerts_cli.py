"""`kvctl alerts rules` and `kvctl alerts test` (against a stand-in Alertmanager on loopback)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import yaml

from kvctl.alerts import render_rule_file


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
