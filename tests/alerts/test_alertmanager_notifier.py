"""AlertmanagerNotifier's own policy, on a scripted transport: what it posts and when, its
back-off while Alertmanager is down, and the bounds of its queue. (The wire format against a
real Alertmanager is tested in test_alertmanager_real.py.)"""

from __future__ import annotations

import base64
import json

import httpx
import pytest

from kvctl import api
from kvctl.alerts import AlertmanagerError, AlertmanagerNotifier, post_test_alert
from kvctl.alerts.alertmanager import isoformat

URL = "http://am.example:9093"
T0 = 1_700_000_000.0


class ScriptedAlertmanager:
    """Records every post; `up` decides whether it answers 200, `status` what it answers."""

    def __init__(self) -> None:
        self.up = True
        self.status = 200
        self.posts: list[list[dict]] = []
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        self.requests.append(request)
        self.posts.append(json.loads(request.content))
        return httpx.Response(self.status, text="" if self.status == 200 else "bad alert")

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def alert(name: str = "KvctlPoolNearlyFull", state: str = "firing", **changes) -> api.Alert:
    fields = dict(
        name=name,
        severity="warning",
        state=state,
        value=0.97,
        summary=f"{name} summary",
        description="pool 97% full",
        remediation="Run `kvctl --agent http://n:8477 pool resize --pages 640`",
        runbook_url=f"http://n:8477/runbook#{name.lower()}",
        active_since=T0 - 60,
        labels={"alertname": name, "severity": "warning", "pool": "demo", "instance": "n:8477"},
    )
    return api.Alert(**{**fields, **changes})


@pytest.fixture
def am() -> ScriptedAlertmanager:
    return ScriptedAlertmanager()


def notifier(am: ScriptedAlertmanager, **options) -> AlertmanagerNotifier:
    return AlertmanagerNotifier(URL, lambda: T0, am.transport, **options)


def test_a_firing_alert_is_posted_with_labels_annotations_and_times(am) -> None:
    n = notifier(am)
    n.sync([alert(), alert("KvctlFragmentationHigh", state="pending")], now=T0)

    assert str(am.requests[0].url) == f"{URL}/api/v2/alerts"
    assert am.posts == [
        [
            {
                "labels": {
                    "alertname": "KvctlPoolNearlyFull",
                    "severity": "warning",
                    "pool": "demo",
                    "instance": "n:8477",
                },
                "annotations": {
                    "summary": "KvctlPoolNearlyFull summary",
                    "description": "pool 97% full",
                    "remediation": "Run `kvctl --agent http://n:8477 pool resize --pages 640`",
                    "runbook_url": "http://n:8477/runbook#kvctlpoolnearlyfull",
                },
                "startsAt": isoformat(T0),
                "endsAt": isoformat(T0 + 4 * 45),  # resolves itself if the agent dies
            }
        ]
    ]  # the pending alert is not sent


def test_firing_alerts_are_resent_every_interval_and_resolved_once(am) -> None:
    n = notifier(am, resend_interval=45.0)
    for t in (0, 15, 30, 45, 60, 90):
        n.sync([alert(description=f"at {t}")], now=T0 + t)
    assert [p[0]["annotations"]["description"] for p in am.posts] == ["at 0", "at 45", "at 90"]
    assert {p[0]["startsAt"] for p in am.posts} == {isoformat(T0)}

    n.sync([], now=T0 + 100)
    n.sync([], now=T0 + 200)
    assert len(am.posts) == 4
    resolved = am.posts[-1][0]
    assert resolved["labels"] == am.posts[0][0]["labels"]
    assert resolved["annotations"]["description"] == "at 90"
    assert resolved["endsAt"] == isoformat(T0 + 100)


def test_retries_back_off_exponentially_up_to_the_cap(am) -> None:
    am.up = False
    n = notifier(am, backoff_initial=1.0, backoff_max=8.0)
    attempts = []
    n.sync([alert()], now=T0)
    for tick in range(1, 61):
        before = n.failures_total
        n.flush(T0 + tick * 0.5)
        if n.failures_total > before:
            attempts.append(tick * 0.5)
    # failed at 0; retries 1, 2, 4, 8, then every 8 s
    assert attempts == [1.0, 3.0, 7.0, 15.0, 23.0]
    assert n.queued == 1 and n.dropped_total == 0 and am.posts == []

    am.up = True
    n.flush(T0 + 31.0)
    assert len(am.posts) == 1 and n.queued == 0 and n.last_error is None
    n.sync([alert()], now=T0 + 31.5)  # back-off is over: a new change goes out at once
    n.sync([alert("KvctlFragmentationHigh")], now=T0 + 32)
    assert len(am.posts) == 2


def test_nothing_is_lost_while_alertmanager_is_down_for_less_than_the_span(am) -> None:
    n = notifier(am, queue_span=600.0, backoff_max=30.0)
    am.up = False
    a, b = alert("KvctlPoolNearlyFull"), alert("KvctlFragmentationHigh")
    n.sync([a], now=T0)
    n.sync([a, b], now=T0 + 60)
    n.sync([b], now=T0 + 120)  # a resolved while Alertmanager is down
    for t in range(135, 540, 15):
        n.sync([b], now=T0 + t)
    am.up = True
    n.sync([b], now=T0 + 540)

    assert n.dropped_total == 0
    [post] = am.posts
    by_name = {x["labels"]["alertname"]: x for x in post}
    assert by_name["KvctlPoolNearlyFull"]["endsAt"] == isoformat(T0 + 120)
    assert by_name["KvctlFragmentationHigh"]["startsAt"] == isoformat(T0 + 60)
    assert by_name["KvctlFragmentationHigh"]["endsAt"] == isoformat(T0 + 540 + 180)


def test_updates_older_than_the_span_are_dropped_and_counted(am) -> None:
    n = notifier(am, queue_span=600.0)
    am.up = False
    n.sync([alert()], now=T0)
    n.sync([], now=T0 + 30)  # resolved; Alertmanager never heard of it
    n.sync([], now=T0 + 630)
    assert n.queued == 1 and n.dropped_total == 0
    n.sync([], now=T0 + 631)
    assert n.queued == 0 and n.dropped_total == 1


def test_the_queue_keeps_at_most_max_queue_alerts(am) -> None:
    n = notifier(am, max_queue=2)
    am.up = False
    names = ["KvctlPoolNearlyFull", "KvctlFragmentationHigh", "KvctlPreemptionStorm"]
    n.sync([alert(name) for name in names], now=T0)
    assert n.queued == 2 and n.dropped_total == 1
    am.up = True
    n.flush(T0 + 10)
    assert [x["labels"]["alertname"] for x in am.posts[0]] == names[1:]


def test_a_rejected_post_is_dropped_not_retried(am) -> None:
    am.status = 400
    n = notifier(am)
    n.sync([alert()], now=T0)
    n.flush(T0 + 100)
    assert len(am.posts) == 1 and n.dropped_total == 1 and n.queued == 0
    assert "answered 400: bad alert" in (n.last_error or "")


def test_a_server_error_is_retried(am) -> None:
    am.status = 503
    n = notifier(am, backoff_initial=1.0)
    n.sync([alert()], now=T0)
    am.status = 200
    n.flush(T0 + 1)
    assert len(am.posts) == 2 and n.queued == 0 and n.dropped_total == 0


def test_credentials_go_into_the_request(am) -> None:
    notifier(am, bearer_token="s3cret").sync([alert()], now=T0)
    notifier(am, basic_auth=("ops", "pw")).sync([alert()], now=T0)
    assert am.requests[0].headers["authorization"] == "Bearer s3cret"
    expected = base64.b64encode(b"ops:pw").decode()
    assert am.requests[1].headers["authorization"] == f"Basic {expected}"
    with pytest.raises(ValueError, match="not both"):
        notifier(am, basic_auth=("ops", "pw"), bearer_token="s3cret")


def test_the_test_alert_is_an_info_alert_that_ends_in_minutes(am) -> None:
    sent = post_test_alert(URL, pool="demo", instance="n:8477", now=T0, transport=am.transport)
    [[posted]] = am.posts
    assert posted == sent
    assert posted["labels"] == {
        "alertname": "KvctlTestAlert",
        "severity": "info",
        "pool": "demo",
        "instance": "n:8477",
    }
    assert posted["startsAt"] == isoformat(T0) and posted["endsAt"] == isoformat(T0 + 300)
    assert "test alert sent by kvctl" in posted["annotations"]["summary"].lower()

    am.status = 400
    with pytest.raises(AlertmanagerError, match="refused the test alert: 400"):
        post_test_alert(URL, transport=am.transport)


def test_a_severity_change_resolves_the_old_label_set_and_fires_the_new(am) -> None:
    """Alertmanager identifies an alert by its labels, severity included: an escalation that
    only re-posted would leave the warning firing next to the critical one."""
    n = notifier(am)
    labels = {"alertname": "KvctlAllocationFailures", "pool": "demo", "instance": "n:8477"}
    warning = alert("KvctlAllocationFailures", labels={**labels, "severity": "warning"})
    critical = alert(
        "KvctlAllocationFailures", severity="critical", labels={**labels, "severity": "critical"}
    )
    n.sync([warning], now=T0)
    n.sync([critical], now=T0 + 15)
    [first], second = am.posts
    assert first["labels"]["severity"] == "warning"
    by_severity = {x["labels"]["severity"]: x for x in second}
    assert set(by_severity) == {"warning", "critical"}
    assert by_severity["warning"]["endsAt"] == isoformat(T0 + 15)  # resolved now
    assert by_severity["critical"]["startsAt"] == isoformat(T0 + 15)
    assert by_severity["critical"]["endsAt"] == isoformat(T0 + 15 + 4 * 45)  # firing
    n.sync([warning], now=T0 + 30)  # and back
    back = {x["labels"]["severity"]: x for x in am.posts[2]}
    assert back["critical"]["endsAt"] == isoformat(T0 + 30)
    assert back["warning"]["endsAt"] == isoformat(T0 + 30 + 4 * 45)


def test_an_agents_test_alert_carries_its_job_and_runbook(am) -> None:
    sent = post_test_alert(
        URL,
        pool="demo",
        instance="node-1:8477",
        job="kvctl-agent",
        runbook_base="http://node-1:8477/runbook",
        now=T0,
        transport=am.transport,
    )
    assert sent["labels"] == {
        "alertname": "KvctlTestAlert",
        "severity": "info",
        "pool": "demo",
        "instance": "node-1:8477",
        "job": "kvctl-agent",
    }
    assert sent["annotations"]["runbook_url"] == "http://node-1:8477/runbook#kvctltestalert"
