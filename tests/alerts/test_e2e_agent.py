"""End to end: real agents, a real Prometheus with the generated rule file, one real Alertmanager,
and a receiver that records what Alertmanager notifies.

An agent bound to 0.0.0.0 with a token, advertised as http://127.0.0.1:PORT, pushes its own
alerts while Prometheus scrapes it with the token and evaluates the rule file, both into the same
Alertmanager. What arrives carries one identity (`job`, and `instance` = the advertised
host:port, the same as Prometheus' scrape), commands aimed at the advertised URL, and a runbook
link the agent answers. Each condition is notified once and resolved once: the agent's own
alert (tripped by a threshold PATCHed onto a pool that served one request) comes only from the
agent, and `KvctlAgentDown` (the agent stopped) only from Prometheus. Under real load on a pool
too small, the allocation alert names the command that fixes it, and running it resolves the
alert. The tiers below the pool raise theirs from what really happens to them: a host tier that
stores unique prompts nobody reuses, a disk tier whose directory is replaced by a file, a disk
tier larger than its filesystem's free space (fixed by the command its alert names), host loads
dearer than a (lowered) share of the measured prefill cost; each resolves once the cause is
gone. Two models that both outgrow the KV budget they share raise one budget alert per pool,
resolved when their load stops.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import httpx
import pytest
from agent_process import SMALL_POOL, RunningAgent, launch_agent
from prometheus_client.parser import text_string_to_metric_families

from kvctl.alerts import fetch_alerts, post_test_alert, render_rule_file
from kvctl.api import AlertSettings
from kvctl.units import parse_size

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
    over-provisioning alert is off until a PATCH turns it on, its prefix hit rate alert off."""
    return launch_agent(
        *SMALL_POOL,
        *("--host", "0.0.0.0", "--port", str(port)),
        *("--advertise-url", f"http://127.0.0.1:{port}"),
        *("--alertmanager-url", am_url, "--alert-interval", "1s", "--alert-for", "0s"),
        *("--set", "alerts.utilization_low=0", "--set", "alerts.prefix_hit_min=0"),
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

        # the agent's own alert, tripped by a threshold change once the pool served a request
        body = {"model": "demo", "prompt": "hello", "max_tokens": 2}
        httpx.post(f"{url}/v1/completions", json=body, headers=auth).raise_for_status()
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


# ---- tiers below the pool ---------------------------------------------------------------------

TIER_ALERTS = (
    *("--alert-interval", "1s", "--alert-for", "0s", "--stats-window", "4s"),
    *("--set", "alerts.utilization_low=0", "--set", "alerts.prefix_hit_min=0"),
)
"""Alerts every second on a 4 s window, those about the pool's size and hit rate off."""
TIER_AGENT = ("--pool-pages", "32", "--segment-pages", "32", "--page-size", "16", *TIER_ALERTS)
"""A pool of a few prompts' pages, so each new prompt evicts the last ones'."""
_UNIQUE = itertools.count()


def drive_unique(url: str, stop: threading.Event) -> None:
    """Unique prompts of a few pages, one at a time, until told to stop: the device evicts
    each one's pages to make room for the next, and none is ever asked for again."""
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            n = next(_UNIQUE)
            prompt = f"{n} a prompt nobody sends twice {n} " * 5
            http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})


class Traffic:
    """`drive_unique` in a thread, for a `with` block."""

    def __init__(self, url: str) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=drive_unique, args=(url, self.stop), daemon=True)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def tier_alerts(stack, name: str, agent: RunningAgent, **labels: str) -> list[dict]:
    """Active alerts `name` of `agent` in Alertmanager with `labels`."""
    instance = agent.url.removeprefix("http://")
    return [
        a
        for a in named(stack, name)
        if a["labels"]["instance"] == instance
        and all(a["labels"].get(k) == v for k, v in labels.items())
    ]


def disk_tier(agent: RunningAgent) -> dict:
    """The disk tier's reading in the agent's /v1/pool."""
    tiers = httpx.get(f"{agent.url}/v1/pool").json()["tiers"]
    return next(t for t in tiers if t["tier"] == "disk")


def samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The agent's series `name`, by their labels other than `pool`."""
    body = httpx.get(f"{url}/metrics").text
    return {
        tuple(sorted((k, v) for k, v in sample.labels.items() if k != "pool")): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == name
    }


def test_a_host_tier_nobody_loads_from_fires_and_resolves_when_stores_stop(prom_stack) -> None:
    am_url = prom_stack.start_alertmanager()
    agent = launch_agent(
        *TIER_AGENT,
        *("--host-tier-memory", "8MiB", "--alertmanager-url", am_url),
        *("--set", "alerts.tier_stores_min=4"),
    )
    try:
        with Traffic(agent.url):
            [alert] = prom_stack.wait_for(
                lambda: tier_alerts(prom_stack, "KvctlTierStoresUnused", agent, tier="host"),
                "KvctlTierStoresUnused from the agent",
            )
        assert alert["labels"] == {
            "alertname": "KvctlTierStoresUnused",
            "severity": "warning",
            "pool": "demo",
            "instance": agent.url.removeprefix("http://"),
            "job": "kvctl-agent",
            "tier": "host",
        }
        assert remediation_command(alert) == [
            *("kvctl", "--agent", agent.url),
            *("pool", "resize", "--tier", "host", "--size", "0"),
        ]
        tiers = httpx.get(f"{agent.url}/v1/pool").json()["tiers"]
        [host] = [t for t in tiers if t["tier"] == "host"]
        assert host["stored_pages_total"] > 0 and host["loaded_pages_total"] == 0
        prom_stack.wait_for(
            lambda: not tier_alerts(prom_stack, "KvctlTierStoresUnused", agent),
            "KvctlTierStoresUnused to resolve once the stores stop",
        )
        # the tier series add up to every hit, as /v1/pool counts them
        pool = httpx.get(f"{agent.url}/v1/pool").json()
        by_tier = samples(agent.url, "kvctl_prefix_cache_hits_tokens_total")
        assert set(by_tier) == {(("tier", "device"),), (("tier", "host"),)}
        assert sum(by_tier.values()) == pool["prefix_hits_tokens_total"]
    finally:
        agent.stop()


def test_a_disk_tier_that_cannot_write_fires_and_resolves_once_its_directory_is_back(
    prom_stack, tmp_path
) -> None:
    am_url = prom_stack.start_alertmanager()
    directory = tmp_path / "disk-tier"
    agent = launch_agent(
        *TIER_AGENT,
        *("--disk-tier-path", str(directory), "--disk-tier-size", "64MiB"),
        *("--alertmanager-url", am_url),
    )
    aside = tmp_path / "disk-tier.aside"
    try:
        with Traffic(agent.url):
            prom_stack.wait_for(lambda: disk_tier(agent)["used_pages"], "pages stored on disk")
            directory.rename(aside)
            directory.write_text("not a directory")  # every page file write fails now
            [alert] = prom_stack.wait_for(
                lambda: tier_alerts(
                    prom_stack, "KvctlTierStoreFailures", agent, tier="disk", reason="io"
                ),
                "KvctlTierStoreFailures from the agent",
            )
            assert alert["labels"]["severity"] == "warning"
            assert f"`mkdir -p {directory}`" in alert["annotations"]["remediation"]
            assert "fails although" in alert["annotations"]["description"]
            directory.unlink()
            aside.rename(directory)  # back, while the stores go on
            prom_stack.wait_for(
                lambda: not tier_alerts(prom_stack, "KvctlTierStoreFailures", agent),
                "KvctlTierStoreFailures to resolve a window after the directory is back",
            )
        assert disk_tier(agent)["store_failures_total"]["io"] > 0
        failed = samples(agent.url, "kvctl_kv_tier_store_failures_total")
        assert failed[(("reason", "io"), ("tier", "disk"))] > 0
    finally:
        agent.stop()


def test_a_disk_tier_larger_than_the_free_space_fires_until_resized_to_what_fits(
    prom_stack, tmp_path
) -> None:
    am_url = prom_stack.start_alertmanager()
    directory = tmp_path / "big-tier"
    free = shutil.disk_usage(tmp_path).free
    agent = launch_agent(  # a page of 256 tokens is a 1 MiB file: few slots to index
        *("--pool-pages", "8", "--segment-pages", "8", "--page-size", "256", *TIER_ALERTS),
        *("--disk-tier-path", str(directory), "--disk-tier-size", str(2 * free)),
        *("--alertmanager-url", am_url),
    )
    try:
        [alert] = prom_stack.wait_for(
            lambda: tier_alerts(prom_stack, "KvctlDiskTierFilesystemFull", agent, tier="disk"),
            "KvctlDiskTierFilesystemFull from the agent",
        )
        command = remediation_command(alert)
        assert command[:-1] == [
            *("kvctl", "--agent", agent.url),
            *("pool", "resize", "--tier", "disk", "--size"),
        ]
        fits = parse_size(command[-1])
        assert 0 < fits <= shutil.disk_usage(tmp_path).free
        result = kvctl(*command[1:], "--yes")  # the command the alert names, as it names it
        assert result.returncode == 0, result.stderr
        assert disk_tier(agent)["capacity_bytes"] <= fits
        prom_stack.wait_for(
            lambda: not tier_alerts(prom_stack, "KvctlDiskTierFilesystemFull", agent),
            "KvctlDiskTierFilesystemFull to resolve once the tier fits",
        )
        free = samples(agent.url, "kvctl_kv_tier_filesystem_free_bytes")
        assert set(free) == {(("tier", "disk"),)}
    finally:
        agent.stop()


def drive_cycle(url: str, stop: threading.Event) -> None:
    """Six prompts of about ten pages each, sent in turn until told to stop: the 32-page pool
    holds three, so each comes back after the device evicted it and loads from the host tier."""
    prompts = [f"{n} a prompt that comes back after it left the device {n} " * 3 for n in range(6)]
    with httpx.Client(base_url=url, timeout=60) as http:
        for prompt in itertools.cycle(prompts):
            if stop.is_set():
                return
            http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})


PER_TOKEN = {"s": 1.0, "ms": 1e-3, "µs": 1e-6}
_COST = r"([\d.e+-]+) (s|ms|µs)"


def quoted_costs(alert: dict) -> tuple[float, float]:
    """(load, prefill) seconds per token as a tier-load alert's description quotes them."""
    description = alert["annotations"]["description"]
    match = re.search(rf"took {_COST} a token, while computing one takes {_COST}", description)
    assert match, description
    load, load_unit, prefill, prefill_unit = match.groups()
    return float(load) * PER_TOKEN[load_unit], float(prefill) * PER_TOKEN[prefill_unit]


def test_host_tier_loads_dearer_than_the_bar_fire_and_resolve_when_loads_stop(prom_stack) -> None:
    """Loads from the host tier cost a fraction of prefill on this model, so the alert's bar is
    lowered (`alerts.tier_load_cost_max`) to a cost the loads really exceed: the alert fires from
    measured load and prefill times, names its remedies, and resolves once nothing is loaded."""
    am_url = prom_stack.start_alertmanager()
    agent = launch_agent(
        *TIER_AGENT,
        *("--host-tier-memory", "8MiB", "--alertmanager-url", am_url),
        *("--set", "alerts.tier_load_cost_max=0.01", "--set", "alerts.tier_loads_min=4"),
    )
    stop = threading.Event()
    load = threading.Thread(target=drive_cycle, args=(agent.url, stop), daemon=True)
    load.start()
    try:
        [alert] = prom_stack.wait_for(
            lambda: tier_alerts(prom_stack, "KvctlTierLoadsSlowerThanPrefill", agent, tier="host"),
            "KvctlTierLoadsSlowerThanPrefill from the agent",
        )
        pool = httpx.get(f"{agent.url}/v1/pool").json()
        [host] = [t for t in pool["tiers"] if t["tier"] == "host"]
        assert host["loaded_pages_total"] > 0 and pool["prefill_seconds_per_token"] > 0
        # the costs the alert quotes are those it measured over its window (the totals since
        # start in /v1/pool average other times, and the prefill cost moves on): past the level
        # a firing alert holds to, 80 % of the bar, give or take their 3 significant digits
        per_load, per_prefill = quoted_costs(alert)
        assert per_load > 0 and per_prefill > 0, alert["annotations"]["description"]
        assert per_load / per_prefill > 0.99 * 0.8 * 0.01, alert["annotations"]["description"]
        assert "prefix_cache.tier_min_load_tokens=" in alert["annotations"]["remediation"]
        stop.set()
        load.join(timeout=120)
        prom_stack.wait_for(
            lambda: not tier_alerts(prom_stack, "KvctlTierLoadsSlowerThanPrefill", agent),
            "KvctlTierLoadsSlowerThanPrefill to resolve once nothing is loaded",
        )
    finally:
        stop.set()
        agent.stop()


# ---- several models under one budget ----------------------------------------------------------

BUDGET_AGENT = (
    *("--model", "small=demo", "--model", "big=demo:8x4", "--kv-budget", "3MiB"),
    *("--pool-pages", "64", "--segment-pages", "16", "--page-size", "4"),
    *("--alert-interval", "1s", "--alert-for", "1s"),
)
"""Two models whose pools (1 MiB and 2 MiB of 256 tokens each) fill the 3 MiB budget; alerts
every second, the budget alert's `for` 5 s."""


def drive_model(url: str, model: str, stop: threading.Event) -> None:
    """Requests of about 180 tokens to `model`, one after another, until told to stop: a few of
    these at once are more than its pool holds, so the rest wait for pages."""
    with httpx.Client(base_url=url, timeout=120) as http:
        while not stop.is_set():
            n = next(_UNIQUE)
            body = {"model": model, "prompt": f"{n} a long prompt " * 8, **LOAD, "max_tokens": 48}
            try:
                http.post("/v1/completions", json=body)
            except httpx.HTTPError:  # the agent stopping under the test's feet
                time.sleep(0.1)


NAME = "KvctlKvBudgetExhausted"


def both_exhausted(stack) -> list[dict]:
    """KvctlKvBudgetExhausted of both pools, once both are active in Alertmanager."""
    found = named(stack, NAME)
    return found if {a["labels"]["pool"] for a in found} == {"small", "big"} else []


def test_a_budget_both_models_outgrow_fires_per_pool_and_resolves_when_load_stops(
    prom_stack,
) -> None:
    """Both models take more load than their pools hold: each pool is under pressure, the budget
    is all assigned and neither pool can give, so each raises KvctlKvBudgetExhausted with its
    own `pool` label and a larger `--kv-budget`; once the load stops, both resolve."""
    am_url = prom_stack.start_alertmanager()
    agent = launch_agent(*BUDGET_AGENT, "--alertmanager-url", am_url)
    stop = threading.Event()
    load = [
        threading.Thread(target=drive_model, args=(agent.url, model, stop), daemon=True)
        for model in ("small", "big")
        for _ in range(3)
    ]
    for thread in load:
        thread.start()
    try:
        alerts = prom_stack.wait_for(
            lambda: both_exhausted(prom_stack), "KvctlKvBudgetExhausted of both pools"
        )
        for alert in alerts:
            assert alert["labels"]["severity"] == "warning"
            assert alert["labels"]["instance"] == agent.url.removeprefix("http://")
            assert (
                "both pools of the budget are under pressure"
                in (alert["annotations"]["description"])
            )
            match = re.search(r"`--kv-budget (\S+)`", alert["annotations"]["remediation"])
            assert match, alert["annotations"]["remediation"]
            assert parse_size(match.group(1)) > 3 << 20  # more than the budget now
        pools = httpx.get(f"{agent.url}/v1/pools").json()
        assert pools["assigned_bytes"] == pools["budget_bytes"] == 3 << 20
        stop.set()
        for thread in load:
            thread.join(timeout=120)
        prom_stack.wait_for(
            lambda: not named(prom_stack, NAME),
            "KvctlKvBudgetExhausted to resolve once the load stops",
        )
    finally:
        stop.set()
        agent.stop()
