"""AlertmanagerNotifier and post_test_alert against a real Alertmanager process.

The notifier's time is the wall clock here, because Alertmanager judges `endsAt` by its own
clock: a resolved alert is one whose `endsAt` has passed.
"""

from __future__ import annotations

import time

import httpx
import pytest

from kvctl import api
from kvctl.alerts import AlertmanagerError, AlertmanagerNotifier, fetch_alerts, post_test_alert
from kvctl.alerts.alertmanager import TEST_ALERT

pytestmark = pytest.mark.integration


def firing_alert(**changes: object) -> api.Alert:
    fields = dict(
        name="KvctlFragmentationHigh",
        severity="warning",
        state="firing",
        value=0.71,
        summary="KV pool demo at node-1:8477 is fragmented",
        description="fragmentation 0.71 with 212 free pages in 37 extents; auto-defrag is off",
        remediation="Run `kvctl --agent http://node-1:8477 defrag --now`",
        runbook_url="http://node-1:8477/runbook#kvctlfragmentationhigh",
        active_since=time.time() - 60,
        labels={"pool": "demo", "instance": "node-1:8477"},
    )
    return api.Alert(**{**fields, **changes})


def named(alerts: list[dict], name: str) -> list[dict]:
    return [a for a in alerts if a["labels"]["alertname"] == name]


def test_a_firing_alert_arrives_with_its_annotations_and_resolves(alertmanager) -> None:
    notifier = AlertmanagerNotifier(alertmanager.alertmanager_url)
    notifier.sync([firing_alert()])
    assert notifier.queued == 0 and notifier.sent_total == 1

    [got] = named(alertmanager.am_alerts(), "KvctlFragmentationHigh")
    assert got["labels"] == {
        "alertname": "KvctlFragmentationHigh",
        "severity": "warning",
        "pool": "demo",
        "instance": "node-1:8477",
    }
    assert got["annotations"]["remediation"] == firing_alert().remediation
    assert got["annotations"]["runbook_url"] == "http://node-1:8477/runbook#kvctlfragmentationhigh"
    assert "37 extents" in got["annotations"]["description"]
    assert got["status"]["state"] == "active"

    other = {"labels": {"alertname": "NodeDiskFull", "instance": "node-1:9100"}}
    httpx.post(f"{alertmanager.alertmanager_url}/api/v2/alerts", json=[other]).raise_for_status()
    listed = fetch_alerts(alertmanager.alertmanager_url)  # kvctl's alerts only
    assert [a["labels"]["alertname"] for a in listed] == ["KvctlFragmentationHigh"]

    notifier.sync([])  # it stopped firing: resolved with endsAt = now
    assert notifier.sent_total == 2
    alertmanager.wait_for(
        lambda: not fetch_alerts(alertmanager.alertmanager_url),
        "Alertmanager to see the alert resolved",
        timeout=10,
    )


def test_an_escalation_leaves_one_alert_active_in_alertmanager(alertmanager) -> None:
    notifier = AlertmanagerNotifier(alertmanager.alertmanager_url)
    labels = {"pool": "demo", "instance": "node-1:8477", "job": "kvctl-agent"}
    name = "KvctlAllocationFailures"
    notifier.sync([firing_alert(name=name, labels={**labels, "severity": "warning"})])
    notifier.sync(
        [firing_alert(name=name, severity="critical", labels={**labels, "severity": "critical"})]
    )

    def only_critical() -> list[dict]:
        active = named(alertmanager.am_alerts(active="true"), name)
        return active if [a["labels"]["severity"] for a in active] == ["critical"] else []

    [got] = alertmanager.wait_for(only_critical, "the warning resolved, the critical firing", 10)
    assert got["labels"] == {**labels, "alertname": name, "severity": "critical"}


def test_updates_reach_alertmanager_after_it_comes_back(prom_stack) -> None:
    notifier = AlertmanagerNotifier("http://127.0.0.1:9", backoff_initial=0.1)
    notifier.sync([firing_alert()])
    assert notifier.queued == 1 and notifier.failures_total == 1
    assert "cannot reach Alertmanager" in (notifier.last_error or "")

    prom_stack.start_alertmanager()
    notifier.url = prom_stack.alertmanager_url  # Alertmanager is back (here: at a new address)
    assert notifier.flush(time.time() + 1)
    assert notifier.dropped_total == 0
    [got] = named(prom_stack.am_alerts(), "KvctlFragmentationHigh")
    assert got["status"]["state"] == "active"


def test_the_test_alert_is_labelled_as_a_test_and_ends_by_itself(alertmanager) -> None:
    sent = post_test_alert(alertmanager.alertmanager_url, pool="demo", instance="node-1:8477")

    [got] = named(alertmanager.am_alerts(), TEST_ALERT)
    assert got["labels"] == {
        "alertname": TEST_ALERT,
        "severity": "info",
        "pool": "demo",
        "instance": "node-1:8477",
    }
    assert "test alert sent by kvctl" in got["annotations"]["summary"].lower()
    assert got["annotations"] == sent["annotations"]
    assert got["endsAt"].startswith(sent["endsAt"][:16])  # minutes ahead, to the minute


def test_posting_to_nothing_says_where_it_failed() -> None:
    with pytest.raises(
        AlertmanagerError, match=r"cannot reach Alertmanager at http://127\.0\.0\.1:9"
    ):
        post_test_alert("http://127.0.0.1:9", timeout=2)


def test_the_listing_of_kvctls_alerts_includes_those_of_its_engine_rule_files(alertmanager) -> None:
    """`kvctl alerts list --from-am` once said "no alerts" while VllmPreemptionStorm (from
    alerts/vllm-rules.yml) was active: the filter knew only the agents' Kvctl* names."""
    alerts = [
        {"labels": {"alertname": name, "instance": "node-1:8000"}}
        for name in ("VllmPreemptionStorm", "SglangEngineDown", "NodeDiskFull")
    ]
    httpx.post(f"{alertmanager.alertmanager_url}/api/v2/alerts", json=alerts).raise_for_status()
    listed = sorted(a["labels"]["alertname"] for a in fetch_alerts(alertmanager.alertmanager_url))
    assert listed == ["SglangEngineDown", "VllmPreemptionStorm"]
