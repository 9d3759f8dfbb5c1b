"""Delivery of the agent's alerts to Alertmanager (API v2), resilient to Alertmanager outages.

Alertmanager identifies an alert by its labels and keeps the annotations of the latest post, so
the notifier keeps one queued update per alert (an alert whose severity changed is a new label
set: the old one is resolved and the new one fired): a newer update replaces an older one that was
not delivered yet. While Alertmanager is down the queue holds the latest state of every alert,
and retries back off exponentially; an update is dropped (and counted in `dropped_total`) only
when it has waited longer than `queue_span` or the queue holds `max_queue` alerts. Firing alerts
carry `endsAt` a few resend intervals ahead, so if the agent itself dies Alertmanager resolves
them on its own instead of keeping them forever.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx

from kvctl import api
from kvctl.alerts.catalog import RULES_RUNBOOK_BASE, runbook_url
from kvctl.bounded_read import MAX_JSON_BYTES, ReadLimit, check_depth, read
from kvctl.engines import ENGINES

log = logging.getLogger(__name__)

ALERTS_PATH = "/api/v2/alerts"
TEST_ALERT = "KvctlTestAlert"
ENDS_AT_RESENDS = 4
"""A firing alert's `endsAt` is this many resend intervals ahead (Prometheus does the same)."""
KVCTL_ALERT_PREFIXES = ("Kvctl", *(engine.alert_prefix for engine in ENGINES))
"""The names kvctl's alerts start with: its agents' and those of its engine rule files."""
PERMANENT_STATUSES = frozenset({400, 422})
"""Alertmanager rejected the alerts themselves; posting them again cannot succeed."""

LabelKey = tuple[tuple[str, str], ...]


class AlertmanagerError(RuntimeError):
    """Alertmanager could not be reached or refused a post; the message says which and why."""


def isoformat(timestamp: float) -> str:
    """Unix seconds as the RFC 3339 UTC time Alertmanager expects."""
    moment = datetime.fromtimestamp(timestamp, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def make_client(
    *,
    transport: httpx.BaseTransport | None = None,
    basic_auth: tuple[str, str] | None = None,
    bearer_token: str | None = None,
    ca_file: str | None = None,
    timeout: float = 5.0,
) -> httpx.Client:
    """An HTTP client with the optional credentials and CA for one Alertmanager."""
    if basic_auth and bearer_token:
        raise ValueError("give Alertmanager basic auth or a bearer token, not both")
    headers = {"Authorization": f"Bearer {bearer_token}"} if bearer_token else {}
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
    return httpx.Client(
        transport=transport,
        auth=basic_auth,
        headers=headers,
        verify=verify,
        timeout=timeout,
    )


@dataclass
class _Firing:
    started_at: float
    queued_at: float
    annotations: dict[str, str]


@dataclass
class _Update:
    """The latest state of one alert, waiting for delivery; `ends_at` None means firing."""

    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    ends_at: float | None
    queued_at: float

    def payload(self, now: float, resend_interval: float, generator_url: str | None) -> dict:
        ends_at = self.ends_at
        if ends_at is None:
            ends_at = now + ENDS_AT_RESENDS * resend_interval
        body = {
            "labels": self.labels,
            "annotations": self.annotations,
            "startsAt": isoformat(self.starts_at),
            "endsAt": isoformat(ends_at),
        }
        if generator_url:
            body["generatorURL"] = generator_url
        return body


def alert_labels(alert: api.Alert) -> dict[str, str]:
    """The labels that identify `alert` in Alertmanager (alertname and severity always set)."""
    return {**alert.labels, "alertname": alert.name, "severity": alert.severity}


def alert_annotations(alert: api.Alert) -> dict[str, str]:
    return {
        "summary": alert.summary,
        "description": alert.description,
        "remediation": alert.remediation,
        "runbook_url": alert.runbook_url,
    }


class AlertmanagerNotifier:
    """Keeps one Alertmanager in step with the agent's firing alerts.

    Call `sync(alerts, now)` after every evaluation: new firing alerts are posted, firing ones
    re-posted every `resend_interval`, and alerts that stopped firing resolved (same labels,
    `endsAt` = the time they stopped). `flush(now)` retries what is queued and may be called
    more often than `sync`. Not thread-safe: call both from one loop.
    """

    def __init__(
        self,
        url: str,
        clock: Callable[[], float] = time.time,
        transport: httpx.BaseTransport | None = None,
        *,
        client: httpx.Client | None = None,
        basic_auth: tuple[str, str] | None = None,
        bearer_token: str | None = None,
        ca_file: str | None = None,
        resend_interval: float = 45.0,
        queue_span: float = 900.0,
        max_queue: int = 1000,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        timeout: float = 5.0,
        generator_url: str | None = None,
    ) -> None:
        if resend_interval <= 0 or queue_span <= 0 or max_queue < 1:
            raise ValueError("resend_interval, queue_span and max_queue must be positive")
        self.url = url.rstrip("/")
        self.clock = clock
        self._owns_client = client is None
        self.client = client or make_client(
            transport=transport,
            basic_auth=basic_auth,
            bearer_token=bearer_token,
            ca_file=ca_file,
            timeout=timeout,
        )
        self.resend_interval = resend_interval
        self.queue_span = queue_span
        self.max_queue = max_queue
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.generator_url = generator_url
        self._firing: dict[LabelKey, _Firing] = {}
        self._queue: OrderedDict[LabelKey, _Update] = OrderedDict()
        self._backoff = 0.0
        self.retry_at = 0.0
        self.sent_total = 0  # alert updates Alertmanager accepted
        self.dropped_total = 0  # alert updates given up on (too old, queue full, rejected)
        self.failures_total = 0  # posts that failed
        self.last_error: str | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def sync(self, alerts: Iterable[api.Alert], now: float | None = None) -> None:
        """Queue what changed since the last call (pending alerts are not sent), then flush."""
        now = self.clock() if now is None else now
        current: set[LabelKey] = set()
        for alert in alerts:
            if alert.state == "firing":
                current.add(self._note_firing(alert, now))
        for key in self._firing.keys() - current:
            self._resolve(key, now)
        self.flush(now)

    def flush(self, now: float | None = None) -> bool:
        """Post every queued update unless backing off; True when nothing is left queued."""
        now = self.clock() if now is None else now
        self._expire(now)
        if not self._queue:
            return True
        if now < self.retry_at:
            return False
        batch = list(self._queue.values())
        body = [u.payload(now, self.resend_interval, self.generator_url) for u in batch]
        try:
            response = self.client.post(self.url + ALERTS_PATH, json=body)
        except httpx.HTTPError as error:
            self._failed(now, f"cannot reach Alertmanager at {self.url}: {_clause(error)}")
            return False
        if response.is_success:
            self._delivered(len(batch))
            return True
        status, text = response.status_code, response.text[:200]
        reason = f"Alertmanager at {self.url} answered {status}: {text}"
        if status in PERMANENT_STATUSES:
            self._drop_all(reason)
            return True
        self._failed(now, reason)
        return False

    def close(self) -> None:
        if self._owns_client:
            self.client.close()

    # ---- state changes ----------------------------------------------------------------------

    def _note_firing(self, alert: api.Alert, now: float) -> LabelKey:
        labels = alert_labels(alert)
        key = tuple(sorted(labels.items()))
        firing = self._firing.get(key)
        if firing is None:
            firing = self._firing[key] = _Firing(now, now, alert_annotations(alert))
        elif now - firing.queued_at < self.resend_interval:
            return key
        firing.queued_at = now
        firing.annotations = alert_annotations(alert)
        self._enqueue(key, _Update(labels, firing.annotations, firing.started_at, None, now))
        return key

    def _resolve(self, key: LabelKey, now: float) -> None:
        firing = self._firing.pop(key)
        self._enqueue(key, _Update(dict(key), firing.annotations, firing.started_at, now, now))

    def _enqueue(self, key: LabelKey, update: _Update) -> None:
        self._queue.pop(key, None)  # a newer state of the same alert supersedes it
        self._queue[key] = update
        while len(self._queue) > self.max_queue:
            self._queue.popitem(last=False)
            self.dropped_total += 1

    def _expire(self, now: float) -> None:
        for key in [k for k, u in self._queue.items() if now - u.queued_at > self.queue_span]:
            del self._queue[key]
            self.dropped_total += 1

    def _delivered(self, count: int) -> None:
        if self.last_error is not None:
            log.info("Alertmanager at %s reachable again", self.url)
        self._queue.clear()
        self.sent_total += count
        self._backoff = 0.0
        self.retry_at = 0.0
        self.last_error = None

    def _failed(self, now: float, reason: str) -> None:
        if self.last_error is None:
            log.warning("%s; retrying with back-off, %d alerts queued", reason, len(self._queue))
        self.failures_total += 1
        self.last_error = reason
        self._backoff = min(self.backoff_max, self._backoff * 2 or self.backoff_initial)
        self.retry_at = now + self._backoff

    def _drop_all(self, reason: str) -> None:
        log.error("%s; dropping %d alert updates", reason, len(self._queue))
        self.dropped_total += len(self._queue)
        self._queue.clear()
        self.failures_total += 1
        self.last_error = reason


def build_test_alert(
    *,
    pool: str = "kvctl",
    instance: str | None = None,
    job: str | None = None,
    now: float | None = None,
    duration_s: float = 300.0,
    runbook_base: str = RULES_RUNBOOK_BASE,
) -> dict:
    """The Alertmanager payload of one clearly labelled test alert, resolving by itself. Sent
    by an agent, it carries the agent's `job` and `instance`, as its real alerts do."""
    now = time.time() if now is None else now
    instance = instance or socket.gethostname()
    minutes = f"{duration_s / 60:g} min"
    labels = {"alertname": TEST_ALERT, "severity": "info", "pool": pool, "instance": instance}
    if job:
        labels["job"] = job
    return {
        "labels": labels,
        "annotations": {
            "summary": f"Test alert sent by kvctl from {instance} to check the Alertmanager wiring",
            "description": (
                f"`kvctl alerts test` sent this at {isoformat(now)}; nothing is wrong with pool "
                f"{pool}. It resolves by itself in {minutes}."
            ),
            "remediation": (
                "None needed. If it did not reach your receiver, check the route for "
                '`severity="info"` in your Alertmanager configuration'
            ),
            "runbook_url": runbook_url(runbook_base, TEST_ALERT.lower()),
        },
        "startsAt": isoformat(now),
        "endsAt": isoformat(now + duration_s),
    }


def post_test_alert(
    url: str,
    *,
    pool: str = "kvctl",
    instance: str | None = None,
    job: str | None = None,
    runbook_base: str = RULES_RUNBOOK_BASE,
    now: float | None = None,
    duration_s: float = 300.0,
    transport: httpx.BaseTransport | None = None,
    basic_auth: tuple[str, str] | None = None,
    bearer_token: str | None = None,
    ca_file: str | None = None,
    timeout: float = 5.0,
) -> dict:
    """Post one test alert (`kvctl alerts test`); returns it, raises AlertmanagerError."""
    alert = build_test_alert(
        pool=pool,
        instance=instance,
        job=job,
        now=now,
        duration_s=duration_s,
        runbook_base=runbook_base,
    )
    client = make_client(
        transport=transport,
        basic_auth=basic_auth,
        bearer_token=bearer_token,
        ca_file=ca_file,
        timeout=timeout,
    )
    _exchange(client, "POST", url, "refused the test alert", timeout, json=[alert])
    return alert


def _exchange(
    client: httpx.Client,
    method: str,
    url: str,
    refusal: str,
    timeout: float,
    json: object = None,
    params: dict[str, str] | None = None,
) -> httpx.Response:
    """One call to Alertmanager's alerts endpoint, its answer read within `timeout` in all and
    `MAX_JSON_BYTES`; failures become one-line AlertmanagerErrors."""
    with client:
        request = client.build_request(
            method, url.rstrip("/") + ALERTS_PATH, json=json, params=params
        )
        try:
            response = read(client, request, timeout, MAX_JSON_BYTES)
            if response.is_success:
                check_depth(response.content)
        except httpx.HTTPError as error:
            raise AlertmanagerError(
                f"cannot reach Alertmanager at {url}: {_clause(error)}; "
                "check the URL and that it listens"
            ) from None
        except ReadLimit as error:
            raise AlertmanagerError(
                f"Alertmanager at {url}: {error}, so it was not read; check the URL"
            ) from None
    if not response.is_success:
        raise AlertmanagerError(
            f"Alertmanager at {url} {refusal}: {response.status_code} {response.text[:200]}"
        )
    return response


def fetch_alerts(
    url: str,
    *,
    active_only: bool = True,
    kvctl_only: bool = True,
    transport: httpx.BaseTransport | None = None,
    basic_auth: tuple[str, str] | None = None,
    bearer_token: str | None = None,
    ca_file: str | None = None,
    timeout: float = 5.0,
) -> list[dict]:
    """The alerts Alertmanager holds (`kvctl alerts list --from-am URL`), as API v2 returns them:
    active and not silenced or inhibited by default, kvctl's own only: its agents' (Kvctl*) and
    those of its rule files for engines (Vllm*, Sglang*, ...)."""
    params = {"active": "true", "silenced": "false", "inhibited": "false"} if active_only else {}
    if kvctl_only:
        params["filter"] = f'alertname=~"({"|".join(KVCTL_ALERT_PREFIXES)}).+"'
    client = make_client(
        transport=transport,
        basic_auth=basic_auth,
        bearer_token=bearer_token,
        ca_file=ca_file,
        timeout=timeout,
    )
    return _exchange(client, "GET", url, "answered", timeout, params=params).json()


def _clause(error: Exception) -> str:
    """An exception's text as a clause inside a sentence: one line, no final full stop."""
    return " ".join(str(error).split()).rstrip(".") or type(error).__name__
