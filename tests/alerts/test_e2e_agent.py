"""End to end: a real agent under real load, real Prometheus, real Alertmanager.

A pool too small for the traffic makes allocations fail (the scheduler preempts to survive); the
agent's own evaluation raises KvctlAllocationFailures and pushes it to Alertmanager with its
remediation. The test runs the very `kvctl` command the remediation names, the failures stop,
and the alert resolves in Alertmanager. Meanwhile Prometheus scrapes the agent, loads the
generated rule file without errors, and its recording rules return values.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading

import httpx
import pytest
from agent_process import launch_agent

from kvctl.alerts import fetch_alerts, post_test_alert, render_rule_file
from kvctl.api import AlertSettings

pytestmark = pytest.mark.integration

LOAD = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}


def drive(url: str, prompts: list[str], stop: threading.Event) -> None:
    """Keep several requests in flight until told to stop."""

    def worker(prompt: str) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            while not stop.is_set():
                http.post("/v1/completions", json={"prompt": prompt, **LOAD})

    threads = [threading.Thread(target=worker, args=(p,), daemon=True) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)


def agent_alert(stack, name: str) -> list[dict]:
    """The agent's own pushes of `name` (Prometheus' copies carry a `job` label)."""
    return [
        a
        for a in fetch_alerts(stack.alertmanager_url)
        if a["labels"].get("alertname") == name and "job" not in a["labels"]
    ]


def remediation_command(alert: dict) -> list[str]:
    """The first `kvctl ...` command quoted in the remediation annotation."""
    match = re.search(r"`(kvctl [^`]+)`", alert["annotations"]["remediation"])
    assert match, alert["annotations"]["remediation"]
    return shlex.split(match.group(1))


def test_allocation_failures_alert_reaches_alertmanager_and_resolves(prom_stack) -> None:
    am_url = prom_stack.start_alertmanager()
    agent = launch_agent(
        *("--pool-pages", "24", "--segment-pages", "8", "--page-size", "4"),
        *("--max-pool-pages", "256", "--no-prefix-cache"),
        *("--alertmanager-url", am_url, "--alert-interval", "1s", "--alert-for", "1s"),
        *("--stats-window", "4s"),
    )
    try:
        instance = agent.url.removeprefix("http://")
        prom_stack.start_prometheus([instance], render_rule_file(AlertSettings(for_s=1.0)))
        stop = threading.Event()
        load = threading.Thread(
            target=drive, args=(agent.url, [f"request {i} " * 6 for i in range(6)], stop)
        )
        load.start()
        try:
            firing = prom_stack.wait_for(
                lambda: agent_alert(prom_stack, "KvctlAllocationFailures"),
                "KvctlAllocationFailures from the agent in Alertmanager",
                timeout=90,
            )
        finally:
            stop.set()
            load.join(timeout=180)
        alert = firing[0]
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["pool"] == "demo" and alert["labels"]["instance"] == instance
        assert "allocation" in alert["annotations"]["summary"].lower()
        command = remediation_command(alert)
        assert command[:1] == ["kvctl"]
        result = subprocess.run(
            [sys.executable, "-m", "kvctl.cli.main", *command[1:], "--yes"]
            if "resize" in command
            else [sys.executable, "-m", "kvctl.cli.main", *command[1:]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        pool = httpx.get(f"{agent.url}/v1/pool").json()
        assert pool["capacity_pages"] > 24
        # the same load now fits; the failures age out of the window and the alert resolves
        stop = threading.Event()
        load = threading.Thread(
            target=drive, args=(agent.url, [f"request {i} " * 6 for i in range(6)], stop)
        )
        load.start()
        try:
            prom_stack.wait_for(
                lambda: not agent_alert(prom_stack, "KvctlAllocationFailures"),
                "KvctlAllocationFailures to resolve",
                timeout=90,
            )
        finally:
            stop.set()
            load.join(timeout=180)
        # Prometheus: the rules loaded healthy and the recording rules have values
        groups = prom_stack.rule_groups()
        rules = [rule for group in groups for rule in group["rules"]]
        assert rules and all(rule["health"] == "ok" for rule in rules), rules
        prom_stack.wait_for(
            lambda: prom_stack.query("kvctl:alloc_success:ratio_rate5m"),
            "kvctl:alloc_success:ratio_rate5m to have a value",
            timeout=60,
        )
        assert prom_stack.query("kvctl_pool_capacity_pages")[0]["value"][1] == str(
            pool["capacity_pages"]
        )
    finally:
        agent.stop()


def kvctl(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvctl.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_kvctl_alerts_list_reads_alertmanager(alertmanager) -> None:
    """`kvctl alerts list --from-am URL` shows what reached Alertmanager, remediation included."""
    post_test_alert(alertmanager.alertmanager_url)
    as_json = kvctl("--json", "alerts", "list", "--from-am", alertmanager.alertmanager_url)
    assert as_json.returncode == 0, as_json.stderr
    assert [a["labels"]["alertname"] for a in json.loads(as_json.stdout)] == ["KvctlTestAlert"]
    human = kvctl("alerts", "list", "--from-am", alertmanager.alertmanager_url)
    assert human.returncode == 0 and "KvctlTestAlert" in human.stdout
