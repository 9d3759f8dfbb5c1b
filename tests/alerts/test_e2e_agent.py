"""End to end: real agents, a real Prometheus with the generated rule file, one real Alertmanager,
and a receiver that records what Alertmanager notifies.

An agent bound to 0.0.0.0 with a token, advertised as http://127.0.0.1:PORT, pushes its own
alerts while Prometheus scrapes it with the token and evaluates the rule file, both into the same
Alertmanager. What arrives carries one identity (`job`, and `instance` = the advertised
host:port, the same as Prometheus' scrape), commands aimed at the advertised URL, and a runbook
link the agent answers. Each condition is notified once and resolved once: the agent's own
alert (tripped by a threshold PATCHed onto an idle pool) comes only from the agent, and
`KvctlAgentDown` (the agent stopped) only from Prometheus. Under real load on a pool too small,
the allocation alert names the command that fixes it, and running it resolves the alert.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import httpx
import pytest
from agent_process import SMALL_POOL, RunningAgent, launch_agent

from kvctl.alerts import fetch_alerts, post_test_alert, render_rule_file
from kvctl.api import AlertSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "e2e-s3cret"
LOAD = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
PROMPTS = [f"r{i} " * 4 for i in range(3)]  # 9 pages of 4 tokens each: 27 > 24, 30 <= 32


def kvctl(*args: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KVCTL_AGENT", "KVCTL_TOKEN")}
    if token:
        env["KVCTL_TOKEN"] = token
    command = [sys.executable, "-m", "kvctl.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def remediation_command(alert: dict) -> list[str]:
    """The first `kvctl ...` command quoted in the remediation annotation."""
    match = re.search(r"`(kvctl [^`]+)`", alert["annotations"]["remediation"])
    assert match, alert["annotations"]["remediation"]
    return shlex.split(match.group(1))


def named(stack, name: str) -> list[dict]:
    return [a for a in stack.am_alerts(active="true") if a["labels"]["alertname"] == name]


def notified_once_and_resolved_once(webhook, name: str) -> dict:
    """The one alert `name` the receiver got: one label set, one firing notification, one
    resolved notification."""
    seen = webhook.alerts_of(name)
    assert len({json.dumps(a["labels"], sort_keys=True) for _, a in seen}) == 1, seen
    assert [status for status, _ in seen] == ["firing", "resolved"], seen
    return seen[0][1]


def start_public_agent(tmp_path, port: int, am_url: str) -> RunningAgent:
    """An agent on every interface with a token, advertised at its loopback address; its
    over-provisioning alert is off until a PATCH turns it on."""
    return launch_agent(
        *SMALL_POOL,
        *("--host", "0.0.0.0", "--port", str(port)),
        *("--advertise-url", f"http://127.0.0.1:{port}"),
        *("--alertmanager-url", am_url, "--alert-interval", "1s", "--alert-for", "0s"),
        *("--set", "alerts.utilization_low=0"),
        token=TOKEN,
        tmp=tmp_path,
    )


def test_one_identity_one_owner_each_condition_notified_once(
    prom_stack, webhook, tmp_path, free_port
) -> None:
    am_url = prom_stack.start_alertmanager(webhook.alertmanager_config())
    port = free_port
    url, instance = f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"
    agent = start_public_agent(tmp_path, port, am_url)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        assert httpx.get(f"{url}/metrics").status_code == 401  # the token guards /metrics too
        token_file = tmp_path / "prometheus-token"
        token_file.write_text(TOKEN)
        prom_stack.start_prometheus(
            [instance], render_rule_file(AlertSettings(for_s=1)), token_file=token_file
        )
        [up] = prom_stack.wait_for(
            lambda: prom_stack.query('up{job="kvctl-agent"} == 1'), "a scrape with the token"
        )
        scraped = datetime.now(UTC)  # before its first scrape, "no agent" is true for Prometheus
        assert up["metric"]["instance"] == instance

        # the agent's own alert, tripped on the idle pool by a threshold change
        patch = {"alerts": {"utilization_low": 0.5}}
        httpx.patch(f"{url}/v1/config", json=patch, headers=auth).raise_for_status()
        [alert] = prom_stack.wait_for(
            lambda: named(prom_stack, "KvctlPoolOverProvisioned"), "the agent's alert"
        )
        assert alert["labels"] == {
            "alertname": "KvctlPoolOverProvisioned",
            "severity": "info",
            "pool": "demo",
            "instance": up["metric"]["instance"],  # what Prometheus attaches to its scrape
            "job": up["metric"]["job"],
        }
        assert alert["generatorURL"] == f"{url}/v1/alerts"
        runbook = alert["annotations"]["runbook_url"]
        assert runbook == f"{url}/runbook#kvctlpooloverprovisioned"
        page = httpx.get(runbook.partition("#")[0])  # no token needed for the runbook
        assert page.status_code == 200 and "## KvctlPoolOverProvisioned" in page.text
        command = remediation_command(alert)
        assert command == ["kvctl", "--agent", url, "pool", "resize", "--pages", "32"]
        resized = kvctl(*command[1:], "--yes", token=TOKEN)  # the command works as written
        assert resized.returncode == 0, resized.stderr
        assert httpx.get(f"{url}/v1/pool", headers=auth).json()["capacity_pages"] == 32

        # the test alert goes through the agent's own route, labels and credentials
        sent = kvctl("--agent", url, "--json", "alerts", "test", token=TOKEN)
        assert sent.returncode == 0, sent.stderr
        [test_alert] = prom_stack.wait_for(
            lambda: named(prom_stack, "KvctlTestAlert"), "the agent's test alert"
        )
        assert test_alert["labels"] == json.loads(sent.stdout)["alert"]["labels"]
        assert (test_alert["labels"]["instance"], test_alert["labels"]["job"]) == (
            instance,
            "kvctl-agent",
        )
        assert any(
            "audit action=alert_test outcome=ok" in line and "authenticated=true" in line
            for line in agent.log
        ), agent.log

        prom_stack.wait_for(
            lambda: webhook.alerts_of("KvctlPoolOverProvisioned"), "the agent's alert notified"
        )
        patch = {"alerts": {"utilization_low": 0}}  # 0 turns the alert off
        httpx.patch(f"{url}/v1/config", json=patch, headers=auth).raise_for_status()
        prom_stack.wait_for(
            lambda: (
                [s for s, _ in webhook.alerts_of("KvctlPoolOverProvisioned")][-1:] == ["resolved"]
            ),
            "the agent's alert resolved at the receiver",
        )

        # the agent stops: only Prometheus can say so
        assert agent.stop() == 0
        [down] = prom_stack.wait_for(
            lambda: named(prom_stack, "KvctlAgentDown"), "KvctlAgentDown from Prometheus"
        )
        assert (down["labels"]["instance"], down["labels"]["job"]) == (instance, "kvctl-agent")
        assert f"`kvctl --agent {url} status`" in down["annotations"]["remediation"]
        prom_stack.wait_for(lambda: webhook.alerts_of("KvctlAgentDown"), "KvctlAgentDown notified")
        agent = start_public_agent(tmp_path, port, am_url)  # back on the same address
        prom_stack.wait_for(
            lambda: [s for s, _ in webhook.alerts_of("KvctlAgentDown")][-1:] == ["resolved"],
            "KvctlAgentDown resolved at the receiver",
        )
    finally:
        agent.stop()

    mine = notified_once_and_resolved_once(webhook, "KvctlPoolOverProvisioned")
    assert mine["labels"]["instance"] == instance and mine["labels"]["job"] == "kvctl-agent"
    prometheus = notified_once_and_resolved_once(webhook, "KvctlAgentDown")
    assert prometheus["labels"]["instance"] == instance
    absent = webhook.alerts_of("KvctlAgentAbsent")
    assert not [a for _, a in absent if datetime.fromisoformat(a["startsAt"]) >= scraped], absent
    names = {a["labels"]["alertname"] for n in webhook.notifications for a in n["alerts"]}
    assert names - {"KvctlAgentAbsent"} == {
        "KvctlPoolOverProvisioned",
        "KvctlTestAlert",
        "KvctlAgentDown",
    }


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


def test_allocation_failures_reach_alertmanager_and_the_named_command_resolves_them(
    prom_stack,
) -> None:
    """A pool too small for the load fails allocations: the agent's alert reaches Alertmanager
    as one alert (whatever its severity does meanwhile) and names the command that grows the
    pool; once that command is run, the failures stop and the alert resolves."""
    am_url = prom_stack.start_alertmanager()
    agent = launch_agent(
        *("--pool-pages", "24", "--segment-pages", "8", "--page-size", "4"),
        *("--max-pool-pages", "256"),
        *("--alertmanager-url", am_url, "--alert-interval", "1s", "--alert-for", "1s"),
        *("--stats-window", "4s", "--set", "alerts.alloc_failures_min=2"),
    )
    instance = agent.url.removeprefix("http://")
    counts: list[int] = []
    try:
        stop = threading.Event()
        load = threading.Thread(target=drive, args=(agent.url, PROMPTS, stop))
        load.start()
        try:
            [alert] = prom_stack.wait_for(
                lambda: named(prom_stack, "KvctlAllocationFailures"),
                "KvctlAllocationFailures from the agent",
            )
            for _ in range(8):  # a severity change never leaves two copies behind
                counts.append(len(named(prom_stack, "KvctlAllocationFailures")))
                time.sleep(0.5)
        finally:
            stop.set()
            load.join(timeout=180)
        # never two copies (0 is fine: with a 4 s window the alert may resolve when failures
        # pause, which is the truth, not a duplicate)
        assert max(counts) <= 1, f"copies in Alertmanager over time: {counts}"
        assert alert["labels"]["pool"] == "demo" and alert["labels"]["instance"] == instance
        assert alert["labels"]["severity"] in ("warning", "critical")
        command = remediation_command(alert)
        assert command[:3] == ["kvctl", "--agent", agent.url]
        result = kvctl(*command[1:], *(["--yes"] if "resize" in command else []))
        assert result.returncode == 0, result.stderr
        assert httpx.get(f"{agent.url}/v1/pool").json()["capacity_pages"] > 24
        stop = threading.Event()
        load = threading.Thread(target=drive, args=(agent.url, PROMPTS, stop))
        load.start()
        try:
            prom_stack.wait_for(
                lambda: not named(prom_stack, "KvctlAllocationFailures"),
                "KvctlAllocationFailures to resolve",
            )
        finally:
            stop.set()
            load.join(timeout=180)
    finally:
        agent.stop()


def test_kvctl_alerts_list_reads_alertmanager(alertmanager) -> None:
    """`kvctl alerts list --from-am URL` shows what reached Alertmanager, remediation included."""
    post_test_alert(alertmanager.alertmanager_url)
    as_json = kvctl("--json", "alerts", "list", "--from-am", alertmanager.alertmanager_url)
    assert as_json.returncode == 0, as_json.stderr
    assert [a["labels"]["alertname"] for a in json.loads(as_json.stdout)] == ["KvctlTestAlert"]
    human = kvctl("alerts", "list", "--from-am", alertmanager.alertmanager_url)
    assert human.returncode == 0 and "KvctlTestAlert" in human.stdout
    assert fetch_alerts(alertmanager.alertmanager_url)[0]["labels"]["alertname"] == (
        "KvctlTestAlert"
    )
