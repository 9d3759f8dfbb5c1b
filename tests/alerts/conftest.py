"""Fixtures of the alert tests: snapshots, the Prometheus tools, a real Prometheus +
Alertmanager pair on loopback ports, and a webhook receiver that records what Alertmanager
notifies.

The tools come from the Debian packages `prometheus` and `prometheus-alertmanager` (.ci/run
installs them). A missing tool fails the test when CI is set and skips it elsewhere, so a
laptop without them can still run the rest.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from local_tools import find_binary, free_port
from pool_readings import pool_snapshot
from prom_stack import ALERTMANAGER_CONFIG, PromStack

from kvctl import api


@pytest.fixture
def make_snapshot() -> Callable[..., api.PoolSnapshot]:
    """A snapshot of a healthy pool with the given fields changed (see `pool_snapshot`)."""
    return pool_snapshot


@pytest.fixture
def prom_stack(tmp_path: Path) -> Iterator[PromStack]:
    """An empty stack: start its parts with `start_alertmanager()`, then
    `start_prometheus(targets, rules)`. Every process is stopped by pid afterwards."""
    stack = PromStack(workdir=tmp_path)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def alertmanager(prom_stack: PromStack) -> PromStack:
    """A running Alertmanager (no Prometheus) in the stack."""
    prom_stack.start_alertmanager()
    return prom_stack


class WebhookReceiver:
    """A receiver on loopback that records Alertmanager's webhook notifications: what a pager
    would get. `alerts_of(name)` lists (notification status, alert) for every alert `name` in
    every notification, in order."""

    def __init__(self) -> None:
        self.notifications: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.notifications.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                """Quiet."""

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def alertmanager_config(self) -> dict:
        """An Alertmanager configuration that sends every alert here, resolved ones too, and
        notifies each group at once and then only when it changes."""
        return {
            **ALERTMANAGER_CONFIG,
            "route": {**ALERTMANAGER_CONFIG["route"], "receiver": "recorder"},
            "receivers": [
                {"name": "recorder", "webhook_configs": [{"url": self.url, "send_resolved": True}]}
            ],
        }

    def alerts_of(self, name: str) -> list[tuple[str, dict]]:
        return [
            (alert["status"], alert)
            for notification in list(self.notifications)
            for alert in notification["alerts"]
            if alert["labels"].get("alertname") == name
        ]


@pytest.fixture
def webhook() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


@pytest.fixture(name="free_port")
def free_port_fixture() -> int:
    """A loopback port free now, for a process that must know its port before it starts."""
    return free_port()


@pytest.fixture
def tool() -> Callable[[str], str]:
    """`tool("promtool")`: the path of a Prometheus tool (fails under CI, skips elsewhere)."""
    return find_binary
