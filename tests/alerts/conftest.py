"""Fixtures of the alert tests: snapshots, the Prometheus tools, a real Prometheus +
Alertmanager pair on loopback ports, and a webhook receiver that records what Alertmanager
notifies.

The tools come from the Debian packages `prometheus` and `prometheus-alertmanager` (.ci/run
installs them). A missing tool fails the test when CI is set and skips it elsewhere, so a
laptop without them can still run the rest.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
import yaml
from local_tools import find_binary, free_port
from pool_readings import pool_snapshot

from kvctl import api


@pytest.fixture
def make_snapshot() -> Callable[..., api.PoolSnapshot]:
    """A snapshot of a healthy pool with the given fields changed (see `pool_snapshot`)."""
    return pool_snapshot


# ---- a real Prometheus and Alertmanager -----------------------------------------------------


ALERTMANAGER_CONFIG = {
    "route": {
        "receiver": "blackhole",
        "group_by": ["alertname", "pool", "instance"],
        "group_wait": "1s",
        "group_interval": "1s",
        "repeat_interval": "1h",
    },
    "receivers": [{"name": "blackhole"}],
}


@dataclass
class PromStack:
    """Prometheus (optional) and Alertmanager processes started in `workdir`, stopped by pid."""

    workdir: Path
    alertmanager_url: str = ""
    prometheus_url: str = ""
    processes: list[subprocess.Popen] = field(default_factory=list)
    _logs: list[BinaryIO] = field(default_factory=list)

    def am_alerts(self, **params: str) -> list[dict]:
        """GET /api/v2/alerts of Alertmanager."""
        response = httpx.get(f"{self.alertmanager_url}/api/v2/alerts", params=params, timeout=5)
        response.raise_for_status()
        return response.json()

    def query(self, expr: str) -> list[dict]:
        """An instant PromQL query's result vector."""
        response = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": expr})
        response.raise_for_status()
        return response.json()["data"]["result"]

    def rule_groups(self) -> list[dict]:
        response = httpx.get(f"{self.prometheus_url}/api/v1/rules", timeout=5)
        response.raise_for_status()
        return response.json()["data"]["groups"]

    def wait_for(self, probe: Callable[[], object], what: str, timeout: float = 60.0) -> object:
        """Poll `probe` until it returns something truthy; fail with `what` after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = probe()
            if result:
                return result
            time.sleep(0.25)
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text()[-3000:]}"
            for log in sorted(self.workdir.glob("*.log"))
        )

    def start(self, name: str, args: list[str], port: int) -> str:
        """Start one process and wait until it answers /-/ready; its base URL."""
        log = (self.workdir / f"{name}.log").open("wb")
        self._logs.append(log)
        process = subprocess.Popen(
            args, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.processes.append(process)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"{name} exited with {process.returncode}\n{self.logs()}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail(f"{name} not ready after 30 s\n{self.logs()}")

    def start_alertmanager(self, config: dict | None = None) -> str:
        """Start Alertmanager (a lone instance, no gossip); its base URL."""
        directory = self.workdir / "alertmanager"
        directory.mkdir()
        config_file = directory / "alertmanager.yml"
        config_file.write_text(yaml.safe_dump(config or ALERTMANAGER_CONFIG))
        port = free_port()
        args = [
            find_binary("alertmanager"),
            f"--config.file={config_file}",
            f"--storage.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",  # no gossip port: a lone instance
            "--log.level=warn",
        ]
        self.alertmanager_url = self.start("alertmanager", args, port)
        return self.alertmanager_url

    def start_prometheus(
        self,
        targets: list[str],
        rules: str,
        *,
        job: str = "kvctl-agent",
        interval: str = "1s",
        token_file: Path | None = None,
    ) -> str:
        """Prometheus scraping `targets` as `job` (with the bearer token in `token_file`, as
        agent/prometheus-scrape.yml does), evaluating `rules`, alerting the stack's
        Alertmanager (start that first)."""
        directory = self.workdir / "prometheus"
        directory.mkdir()
        (directory / "rules.yml").write_text(rules)
        am = self.alertmanager_url.removeprefix("http://")
        scrape: dict = {"job_name": job, "static_configs": [{"targets": targets}]}
        if token_file is not None:
            scrape["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": ["rules.yml"],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [am]}]}]},
            "scrape_configs": [scrape],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        args = [
            find_binary("prometheus"),
            f"--config.file={directory / 'prometheus.yml'}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        self.prometheus_url = self.start("prometheus", args, port)
        return self.prometheus_url

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
        self.processes.clear()
        for log in self._logs:
            log.close()


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
