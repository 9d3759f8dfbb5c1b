"""A real Prometheus and Alertmanager on loopback ports, for the tests that need the real thing
(alerts end to end, the fleet read from Prometheus). Every process is stopped by pid."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
import yaml
from local_tools import find_binary, free_port

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
        scrape_configs: list[dict] | None = None,
    ) -> str:
        """Prometheus scraping `targets` as `job` (with the bearer token in `token_file`, as
        agent/prometheus-scrape.yml does), or `scrape_configs` as given, evaluating `rules`,
        alerting the stack's Alertmanager (if one was started first)."""
        directory = self.workdir / "prometheus"
        directory.mkdir()
        (directory / "rules.yml").write_text(rules)
        am = self.alertmanager_url.removeprefix("http://")
        scrape: dict = {"job_name": job, "static_configs": [{"targets": targets}]}
        if token_file is not None:
            scrape["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
        config: dict = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": ["rules.yml"],
            "scrape_configs": scrape_configs or [scrape],
        }
        if am:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [am]}]}]}
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
