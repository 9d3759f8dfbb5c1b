"""The agent's own alerts and the KV-events publisher's counters in /metrics.

Prometheus' ALERTS holds only the rules Prometheus evaluates; the agent evaluates its pools'
alerts itself, so without `kvctl_alerts_active` a pool in trouble looks alert-free there. Each
scrape reads the alert loop's current list and the publisher's counters, so a resolved alert is
gone at the next scrape. The last test drives a real agent's alert through pending, firing and
resolved and reads each step from its /metrics.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pytest
from agent_process import SMALL_POOL, RunningAgent
from metric_samples import Samples, kvctl_samples
from pool_readings import pool_snapshot
from prometheus_client.parser import text_string_to_metric_families

from kvctl import api
from kvctl.agent.observe import kv_events as kv
from kvctl.agent.observe.alerting import AlertLoop
from kvctl.agent.observe.metrics import Histograms, KvEventCounters, pools_registry, render
from kvctl.alerts import AlertEvaluator

ACTIVE = "kvctl_alerts_active"
KV_EVENT_FAMILIES = (
    "kvctl_kv_events_published_batches_total",
    "kvctl_kv_events_dropped_batches_total",
    "kvctl_kv_events_dropped_total",
    "kvctl_kv_events_replay_ignored_total",
)

Series = Samples


def alert(name: str, severity: str, state: str, **labels: str) -> api.Alert:
    return api.Alert(
        name=name,
        severity=severity,  # type: ignore[arg-type]
        state=state,  # type: ignore[arg-type]
        value=1.0,
        summary="",
        description="",
        remediation="",
        runbook_url="",
        active_since=0.0,
        labels={"alertname": name, "severity": severity, **labels},
    )


def scrape(
    alerts: Callable[[], Sequence[api.Alert]],
    pools: Sequence[str] = ("a", "b"),
    kv_events: Callable[[], KvEventCounters | None] = lambda: None,
) -> Series:
    """Every `kvctl_*` sample of one scrape of pools `pools`."""
    readings = [(pool_snapshot(pool=pool), Histograms()) for pool in pools]
    return kvctl_samples(render(pools_registry(lambda: readings, alerts, kv_events))[0].decode())


def active(samples: Series) -> dict[tuple[str, str, str, str], float]:
    """(pool, alertname, severity, state) -> value of every `kvctl_alerts_active` series."""
    out = {}
    for (name, labels), value in samples.items():
        if name == ACTIVE:
            got = dict(labels)
            assert set(got) == {"pool", "alertname", "severity", "state"}, got
            out[got["pool"], got["alertname"], got["severity"], got["state"]] = value
    return out


# ---- the family, from a list of alerts ------------------------------------------------------


def test_firing_and_pending_alerts_each_have_a_series_on_their_pool() -> None:
    alerts = [
        alert("KvctlPoolNearlyFull", "critical", "firing", pool="a", instance="n:1", job="j"),
        alert("KvctlQueueStalled", "warning", "pending", pool="b"),
    ]
    assert active(scrape(lambda: alerts)) == {
        ("a", "KvctlPoolNearlyFull", "critical", "firing"): 1,
        ("b", "KvctlQueueStalled", "warning", "pending"): 1,
    }


def test_an_alert_without_a_pool_is_on_every_pools_series() -> None:
    alerts = [alert("KvctlAgentWide", "warning", "firing"), alert("KvctlBlank", "info", "pending")]
    alerts[1].labels["pool"] = ""
    assert active(scrape(lambda: alerts)) == {
        ("a", "KvctlAgentWide", "warning", "firing"): 1,
        ("b", "KvctlAgentWide", "warning", "firing"): 1,
        ("a", "KvctlBlank", "info", "pending"): 1,
        ("b", "KvctlBlank", "info", "pending"): 1,
    }


def test_alerts_told_apart_by_a_further_label_are_one_series() -> None:
    alerts = [
        alert("KvctlTierStoreFailures", "warning", "firing", pool="a", tier="host"),
        alert("KvctlTierStoreFailures", "warning", "firing", pool="a", tier="disk"),
        alert("KvctlTierStoreFailures", "warning", "pending", pool="a", tier="disk"),
    ]
    assert active(scrape(lambda: alerts)) == {
        ("a", "KvctlTierStoreFailures", "warning", "firing"): 1,
        ("a", "KvctlTierStoreFailures", "warning", "pending"): 1,
    }


def test_each_scrape_reads_the_current_list_so_resolved_alerts_disappear() -> None:
    current: list[api.Alert] = [alert("KvctlQueueStalled", "warning", "pending", pool="a")]
    readings = [(pool_snapshot(pool="a"), Histograms())]
    registry = pools_registry(lambda: readings, lambda: current)

    def shown() -> dict[tuple[str, str, str, str], float]:
        return active(kvctl_samples(render(registry)[0].decode()))

    assert shown() == {("a", "KvctlQueueStalled", "warning", "pending"): 1}
    current = [alert("KvctlQueueStalled", "warning", "firing", pool="a")]
    assert shown() == {("a", "KvctlQueueStalled", "warning", "firing"): 1}
    current = []  # resolved
    assert ACTIVE not in render(registry)[0].decode()  # not even its HELP line


def test_no_alerts_no_series() -> None:
    assert active(scrape(lambda: [])) == {}


def test_the_alert_loops_evaluations_are_what_a_scrape_shows() -> None:
    """The real evaluator over a pool whose utilization falls and recovers: pending, firing
    after its `for` duration (30 x for_s for this alert), gone once the pool is used again."""
    now = [1_000.0]
    settings = api.RuntimeSettings(alerts=api.AlertSettings(for_s=1, utilization_low=0.3))
    snapshot = [pool_snapshot(pool="a", used_pages=0, cached_pages=0, requests_running=0)]
    evaluator = AlertEvaluator(settings, "a", "node-1:8477", lambda: now[0])
    loop = AlertLoop(evaluator, lambda: snapshot[0], lambda: settings)
    readings = [(pool_snapshot(pool="a"), Histograms())]
    registry = pools_registry(lambda: readings, lambda: loop.alerts)

    def shown() -> set[tuple[str, str]]:
        samples = text_string_to_metric_families(render(registry)[0].decode())
        return {
            (s.labels["alertname"], s.labels["state"])
            for family in samples
            if family.name == ACTIVE
            for s in family.samples
        }

    assert shown() == set()
    loop.evaluate_once()
    assert shown() == {("KvctlPoolOverProvisioned", "pending")}
    now[0] += 31
    loop.evaluate_once()
    assert shown() == {("KvctlPoolOverProvisioned", "firing")}
    assert [(a.name, a.state) for a in loop.alerts] == [("KvctlPoolOverProvisioned", "firing")]
    snapshot[0] = pool_snapshot(pool="a")  # half the pool in use again
    now[0] += 1
    loop.evaluate_once()
    assert shown() == set()


# ---- the KV-events publisher ----------------------------------------------------------------


def cleared() -> list[Any]:
    return [kv.AllBlocksCleared(), kv.AllBlocksCleared()]


def test_a_publishers_drops_are_exported_on_every_pool() -> None:
    publisher = kv.KVEventPublisher("tcp://127.0.0.1:0", max_queue_size=1)
    try:
        for _ in range(4):  # not started: the first fills the queue, the other three drop
            publisher.submit(b"t", cleared())
        samples = scrape(lambda: [], kv_events=lambda: publisher)
    finally:
        publisher.close()
    for pool in ("a", "b"):
        labels = frozenset({("pool", pool)})
        assert samples["kvctl_kv_events_dropped_batches_total", labels] == 3
        assert samples["kvctl_kv_events_dropped_total", labels] == 6
        assert samples["kvctl_kv_events_published_batches_total", labels] == 0


def test_no_publisher_no_kv_event_series() -> None:
    names = {name for name, _ in scrape(lambda: [])}
    assert not names & set(KV_EVENT_FAMILIES)


def test_a_scrape_takes_no_lock_the_engine_thread_holds() -> None:
    """`submit` (the engine thread) counts drops under the publisher's lock; a scrape reads the
    counters without it, so it never waits for a step."""
    publisher = kv.KVEventPublisher("tcp://127.0.0.1:0", max_queue_size=1)
    done = threading.Event()
    try:
        with publisher._lock:
            worker = threading.Thread(
                target=lambda: (scrape(lambda: [], kv_events=lambda: publisher), done.set()),
                daemon=True,
            )
            worker.start()
            assert done.wait(10), "the scrape waited for the publisher's lock"
    finally:
        publisher.close()


# ---- a real agent ---------------------------------------------------------------------------


def metrics_of(agent: RunningAgent) -> Series:
    return kvctl_samples(httpx.get(f"{agent.url}/metrics", timeout=10).text)


def wait_for(agent: RunningAgent, what: str, done: Callable[[Series], bool]) -> Series:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        samples = metrics_of(agent)
        if done(samples):
            return samples
        time.sleep(0.1)
    pytest.fail(f"/metrics never showed {what}: {sorted(k for k in samples if k[0] == ACTIVE)}")


def over_provisioned(samples: Series) -> dict[str, float]:
    """state -> value of the demo pool's KvctlPoolOverProvisioned series."""
    return {
        key[3]: value
        for key, value in active(samples).items()
        if key[:3] == ("demo", "KvctlPoolOverProvisioned", "info")
    }


def listed(agent: RunningAgent) -> list[tuple[str, str]]:
    """(name, state) of every alert the agent lists."""
    alerts = httpx.get(f"{agent.url}/v1/alerts", timeout=10).json()["alerts"]
    return [(a["name"], a["state"]) for a in alerts]


def complete(agent: RunningAgent) -> None:
    """One small completion: traffic for the sizing alert to judge from."""
    body = {"model": "demo", "prompt": "hello", "max_tokens": 2}
    httpx.post(f"{agent.url}/v1/completions", json=body, timeout=60).raise_for_status()


@pytest.mark.integration
def test_a_real_agents_alert_is_pending_then_firing_then_gone(start_agent) -> None:
    """A pool that served one request, then a threshold PATCHed above its utilization: the
    alert is pending for 30 x --alert-for (3 s), fires, and is gone once the threshold is set
    back to 0 (off)."""
    agent = start_agent(
        *SMALL_POOL,
        *("--alert-interval", "1s", "--alert-for", "0.1s"),
        *("--set", "alerts.utilization_low=0", "--set", "alerts.prefix_hit_min=0"),
        *("--kv-events-endpoint", "tcp://127.0.0.1:0"),
    )
    pool = frozenset({("pool", "demo")})
    first = wait_for(
        agent,
        "the start-up KV-events batch published",
        lambda s: s.get(("kvctl_kv_events_published_batches_total", pool), 0) >= 1,
    )
    assert first["kvctl_kv_events_dropped_total", pool] == 0
    assert first["kvctl_kv_events_dropped_batches_total", pool] == 0
    assert ACTIVE not in {name for name, _ in first}

    complete(agent)
    patch = {"alerts": {"utilization_low": 0.5}}
    httpx.patch(f"{agent.url}/v1/config", json=patch, timeout=10).raise_for_status()
    wait_for(agent, "the alert pending", lambda s: over_provisioned(s) == {"pending": 1})
    wait_for(agent, "the alert firing", lambda s: over_provisioned(s) == {"firing": 1})
    assert listed(agent) == [("KvctlPoolOverProvisioned", "firing")]

    patch = {"alerts": {"utilization_low": 0}}  # 0 turns the alert off
    httpx.patch(f"{agent.url}/v1/config", json=patch, timeout=10).raise_for_status()
    gone = wait_for(agent, "the alert resolved", lambda s: not active(s))
    assert ("kvctl_kv_events_dropped_total", pool) in gone  # the publisher's series stay


@pytest.mark.integration
def test_a_fresh_agent_at_the_defaults_raises_no_alert_before_traffic(start_agent) -> None:
    """Nothing is wrong with an agent nobody has sent a request to: no alert right after start
    nor after several evaluations (with no `for`, anything active shows at once). Once the
    mostly empty pool has served a request, the sizing alert has traffic to judge from."""
    agent = start_agent("--alert-interval", "1s", "--alert-for", "0s")
    assert listed(agent) == []
    time.sleep(3.5)
    assert listed(agent) == []
    complete(agent)
    deadline = time.monotonic() + 20
    while ("KvctlPoolOverProvisioned", "firing") not in listed(agent):
        assert time.monotonic() < deadline, listed(agent)
        time.sleep(0.2)


@pytest.mark.integration
def test_the_agent_without_kv_events_exports_none(start_agent) -> None:
    agent = start_agent(*SMALL_POOL)
    names = {name for name, _ in metrics_of(agent)}
    assert "kvctl_pool_capacity_pages" in names
    assert not names & set(KV_EVENT_FAMILIES)
