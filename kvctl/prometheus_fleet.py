"""The fleet table from Prometheus: a few PromQL queries, one per column, for every node at once.

A fleet of a thousand nodes is already scraped; asking each node again costs a thousand calls
and sees only what this machine can reach. Here each column is one instant query over every
engine's metric for it (`kvctl.engines`), each engine's term tagged with a `kvctl_engine`
label and its model label copied to `kvctl_model`, so one answer holds kvctl pools and vLLM,
SGLang and TensorRT-LLM models alike. A row is a (job, instance, model); `up` adds the targets
Prometheus could not scrape, as down rows. A figure a node's engine does not export is absent
from its column's answer, so the row shows "–".

Ratios of counters are taken over `WINDOW` (5m), the span Prometheus users read them over; a
target gone stale has no samples, so its figures vanish instead of freezing.

Each answer is read within the timeout and `MAX_JSON_BYTES`, and refused nested past
`MAX_JSON_DEPTH` (`kvctl.bounded_read`): a Prometheus that drips, floods or nests is one line
and an exit, like one that is down. A node's nonsense (a negative count, an info label of
+Inf) is "–" in its own row, with a note.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from kvctl.api import Alert
from kvctl.bounded_read import MAX_JSON_BYTES, ReadLimit, aread, check_depth
from kvctl.client import DEFAULT_TIMEOUT, AgentProtocolError, AgentUnreachable, tls_context
from kvctl.engines import ENGINES, KVCTL, Engine
from kvctl.exposition import ModelFigures
from kvctl.figures import Figures, from_source
from kvctl.fleet import Reading, settled

WINDOW = "5m"
ENGINE_LABEL = "kvctl_engine"
MODEL_LABEL = "kvctl_model"
KVCTL_POOL_LABEL = "pool"
KVCTL_PAGE_TOKENS = "kvctl_pool_page_size_tokens"
AGENT_ALERTS = "kvctl_alerts_active"
"""The agents' own alerts, which reach Alertmanager from the agent and so are not in ALERTS."""

SEVERITIES: dict[str, Literal["info", "warning", "critical"]] = {
    "info": "info",
    "warning": "warning",
    "critical": "critical",
}
_NOT_ALERT_LABELS = ("__name__", "alertstate", "state")
_SELECTOR = re.compile(r"^\{(?P<inner>.*)\}$", re.DOTALL)


class PrometheusError(Exception):
    """Prometheus could not be asked, or refused a query; `str()` is one line with the fix."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused
        """Prometheus answered and refused the query (400: a bad selector)."""


def selector_matchers(selector: str | None) -> str:
    """The matchers inside `{...}` (empty for None), to put in every metric's selector."""
    if selector is None or not selector.strip():
        return ""
    match = _SELECTOR.match(selector.strip())
    if match is None:
        raise ValueError(
            f"--selector {selector!r}: write label matchers in braces, e.g. '{{job=\"vllm\"}}'"
        )
    return match.group("inner").strip()


@dataclass(frozen=True)
class Column:
    """One query: a term per engine that exports the figure."""

    key: str
    terms: tuple[tuple[str, str], ...]
    """(engine name, PromQL) pairs; `{S}` in the PromQL is where the selector goes."""


def _by(engine: str) -> str:
    label = KVCTL_POOL_LABEL if engine == KVCTL else _engine(engine).model_label
    return ", ".join(label for label in ("job", "instance", label) if label)


def _engine(name: str) -> Engine:
    return next(engine for engine in ENGINES if engine.name == name)


def _model_label(engine: str) -> str | None:
    return KVCTL_POOL_LABEL if engine == KVCTL else _engine(engine).model_label


def _gauge(engine: str, metric: str | None, how: str = "max") -> str | None:
    return None if metric is None else f"{how} by ({_by(engine)}) ({metric}{{S}})"


def _increase(engine: str, metric: str | None) -> str | None:
    if metric is None:
        return None
    return f"sum by ({_by(engine)}) (increase({metric}{{S}}[{WINDOW}]))"


def _rate_ratio(engine: str, hits: str | None, queries: str | None) -> str | None:
    if hits is None or queries is None:
        return None
    rate = f"sum by ({_by(engine)}) (rate({{m}}{{{{S}}}}[{WINDOW}]))"
    return f"{rate.format(m=hits)} / {rate.format(m=queries)}"


def _columns() -> tuple[Column, ...]:
    kvctl = {
        "util": _gauge(KVCTL, "kvctl_pool_utilization_ratio"),
        "pressure": _gauge(KVCTL, "kvctl_pool_pressure_ratio"),
        "alloc": _gauge(KVCTL, "kvctl_alloc_success_ratio"),
        "frag": _gauge(KVCTL, "kvctl_pool_fragmentation_ratio"),
        "prefix": _rate_ratio(
            KVCTL, "kvctl_prefix_cache_hits_tokens_total", "kvctl_prefix_cache_queries_tokens_total"
        ),
        "running": _gauge(KVCTL, "kvctl_requests_running", "sum"),
        "waiting": _gauge(KVCTL, "kvctl_requests_waiting", "sum"),
        "preemptions": _increase(KVCTL, "kvctl_preemptions_total"),
        "blocks": _gauge(KVCTL, "kvctl_pool_capacity_pages", "sum"),
        "bytes": _gauge(KVCTL, "kvctl_pool_capacity_bytes", "sum"),
        "block_tokens": _gauge(KVCTL, KVCTL_PAGE_TOKENS),
    }
    per_engine: dict[str, dict[str, str | None]] = {KVCTL: kvctl}
    for engine in ENGINES:
        name = engine.name
        prefix = engine.prefix
        per_engine[name] = {
            "util": _gauge(name, engine.utilization),
            "pressure": _gauge(name, engine.utilization),
            "prefix": _gauge(name, prefix.gauge)
            if prefix.gauge
            else _rate_ratio(name, prefix.hits, prefix.queries),
            "running": _gauge(name, engine.running, "sum"),
            "waiting": _gauge(name, engine.waiting, "sum"),
            "preemptions": _increase(name, engine.preemptions),
            "blocks": _gauge(name, engine.capacity.blocks, "sum"),
            "block_tokens": _gauge(name, engine.capacity.block_size),
            "tokens": _gauge(name, engine.capacity.tokens, "sum"),
        }
    keys = dict.fromkeys(key for terms in per_engine.values() for key in terms)
    columns = []
    for key in keys:
        terms = [(engine, expr) for engine, row in per_engine.items() if (expr := row.get(key))]
        columns.append(Column(key, tuple(terms)))
    return tuple(columns)


COLUMNS = _columns()


def _tagged(engine: str, expr: str) -> str:
    """`expr` with its engine and its model (the pool, for kvctl) as labels of their own."""
    label = _model_label(engine)
    inner = f"({expr})"
    if label is not None:
        inner = f'label_replace({inner}, "{MODEL_LABEL}", "$1", "{label}", "(.*)")'
    return f'label_replace({inner}, "{ENGINE_LABEL}", "{engine}", "", "")'


def column_query(column: Column, matchers: str) -> str:
    """The column's PromQL: every engine's term, tagged, joined with `or`."""
    terms = [_tagged(engine, expr) for engine, expr in column.terms]
    return " or ".join(terms).replace("{S}", "{" + matchers + "}")


def _info_queries(matchers: str) -> dict[str, str]:
    """Info metrics whose labels carry capacity (vLLM's cache_config_info): read raw."""
    queries = {}
    for engine in ENGINES:
        spec = engine.capacity
        if spec.info is None:
            continue
        labels = ["job", "instance", engine.model_label, spec.block_size_label, spec.blocks_label]
        by = ", ".join(label for label in labels if label)
        queries[engine.name] = f"max by ({by}) ({spec.info}{{{matchers}}})"  # not its 40 labels
    return queries


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    value: float | None


@dataclass
class PrometheusFleet:
    """The fleet as Prometheus at `url` has it, narrowed by `selector` (`{job="vllm"}`)."""

    url: str
    selector: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    token: str | None = None
    """A bearer token for a Prometheus behind an authenticating proxy."""
    transport: httpx.AsyncBaseTransport | None = None
    _http: httpx.AsyncClient = field(init=False)
    _matchers: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self._matchers = selector_matchers(self.selector)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=self.timeout,
            headers=headers,
            transport=self.transport,
            verify=tls_context(),
        )

    def queries(self) -> dict[str, str]:
        """Every query one read sends, by what it is for."""
        matchers = self._matchers
        out = {"up": f"up{{{matchers}}}"}
        out |= {column.key: column_query(column, matchers) for column in COLUMNS}
        out |= {f"info:{name}": query for name, query in _info_queries(matchers).items()}
        rules = f'alertstate="firing", {matchers}' if matchers else 'alertstate="firing"'
        own = f'state="firing", {matchers}' if matchers else 'state="firing"'
        out["alerts"] = f"ALERTS{{{rules}}} or {AGENT_ALERTS}{{{own}}}"
        return out

    async def read(self) -> list[Reading]:
        """One reading per (job, instance, model), in instance order; down targets too."""
        queries = self.queries()
        answers = await settled(*(self._query(q) for q in queries.values()))
        return build_readings(dict(zip(queries, answers, strict=True)))

    async def _query(self, query: str) -> list[Series]:
        request = self._http.build_request("GET", "/api/v1/query", params={"query": query})
        try:
            response = await aread(self._http, request, self.timeout, MAX_JSON_BYTES)
            check_depth(response.content)
        except httpx.TransportError as error:
            reason = str(error) or type(error).__name__
            raise PrometheusError(
                f"cannot reach Prometheus at {self.url} ({reason}); check --prometheus URL"
            ) from None
        except ReadLimit as error:
            raise PrometheusError(
                f"Prometheus at {self.url}: {error}, so it was not read; check --prometheus URL"
            ) from None
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("status") != "success":
            said = body.get("error") if isinstance(body, dict) else response.reason_phrase
            raise PrometheusError(
                f"Prometheus at {self.url} answered {response.status_code}: {said}; "
                "check --prometheus URL and --selector",
                refused=response.status_code == 400,
            )
        try:
            return [_series(item) for item in body.get("data", {}).get("result", [])]
        except (AttributeError, TypeError, IndexError, KeyError):
            raise PrometheusError(
                f"Prometheus at {self.url} answered something that is not a query result; "
                "check --prometheus URL"
            ) from None

    async def aclose(self) -> None:
        await self._http.aclose()


def _series(item: Mapping[str, Any]) -> Series:
    raw = item.get("value", [None, "NaN"])[1]
    try:
        value: float | None = float(raw)
    except (TypeError, ValueError):
        value = None
    if value is not None and (math.isnan(value) or math.isinf(value)):
        value = None  # 0/0: nothing was asked over the window
    labels = item.get("metric", {})
    return Series({str(k): str(v) for k, v in labels.items()}, value)


Key = tuple[str, str, str]
"""(job, instance, model)."""


def _key(labels: Mapping[str, str]) -> Key:
    return (labels.get("job", ""), labels.get("instance", ""), labels.get(MODEL_LABEL, ""))


def build_readings(answers: Mapping[str, Sequence[Series]]) -> list[Reading]:
    """One reading per instance, in instance order, with a row per model (a kvctl pool, an
    engine's model) some column has; an instance whose scrape fails is a down reading."""
    engines: dict[Key, str] = {}
    values: dict[Key, dict[str, float | None]] = {}
    for column in COLUMNS:
        for series in answers.get(column.key, ()):
            key = _key(series.labels)
            engines.setdefault(key, series.labels.get(ENGINE_LABEL, KVCTL))
            values.setdefault(key, {})[column.key] = series.value
    _add_info_capacity(answers, values)
    down = _down_instances(answers.get("up", ()))
    alerts = _alerts(answers.get("alerts", ()))
    rows: dict[str, list[tuple[Key, str]]] = {}
    for key in values:
        rows.setdefault(key[1], []).append((key, engines[key]))
    readings = []
    for instance in sorted(set(rows) | set(down)):
        found = alerts.get(instance, ())
        if instance in down or instance not in rows:
            readings.append(_down(down.get(instance, ""), instance, found))
            continue
        try:
            readings.append(_reading(instance, rows[instance], values, found))
        except (ValueError, ArithmeticError, TypeError) as error:  # its own row says so
            agent = _url(instance)
            said = " ".join(str(error).split()) or type(error).__name__
            message = f"{agent}: its figures in Prometheus could not be read ({said})"
            failed = AgentProtocolError(agent, message)
            readings.append(Reading(agent=agent, source="prometheus", alerts=found, error=failed))
    return readings


def _reading(
    instance: str,
    keys: Sequence[tuple[Key, str]],
    values: Mapping[Key, Mapping[str, float | None]],
    alerts: tuple[Alert, ...],
) -> Reading:
    """One instance's reading: a row per model, with a note for each nonsense number."""
    models = _first_of_each([_model(key[2], engine, values[key]) for key, engine in keys])
    engine = keys[0][1]
    pitfalls = () if engine == KVCTL else _engine(engine).pitfalls
    return Reading(
        agent=_url(instance),
        engine=engine,
        figures=models[0].figures,
        models=tuple(models) if len(models) > 1 else (),
        model=models[0].model or None,
        source="prometheus",
        alerts=alerts,
        notes=pitfalls + tuple(note for model in models for note in model.notes),
    )


def _model(model: str, engine: str, row: Mapping[str, float | None]) -> ModelFigures:
    figures, notes = _figures(engine, row)
    if model and notes:
        notes = tuple(f"{model}: {note}" for note in notes)
    return ModelFigures(model, figures, notes=notes)


def _down_instances(ups: Sequence[Series]) -> dict[str, str]:
    """The instances no job could scrape at its last scrape, with one of their jobs."""
    jobs: dict[str, str] = {}
    scraped: set[str] = set()
    for series in ups:
        instance = series.labels.get("instance", "")
        jobs.setdefault(instance, series.labels.get("job", ""))
        if series.value == 1:
            scraped.add(instance)
    return {instance: job for instance, job in jobs.items() if instance not in scraped}


def _first_of_each(models: list[ModelFigures]) -> list[ModelFigures]:
    """One row per model name (an instance scraped by two jobs answers twice)."""
    seen: dict[str, ModelFigures] = {}
    for model in models:
        seen.setdefault(model.model, model)
    return list(seen.values())


def _add_info_capacity(
    answers: Mapping[str, Sequence[Series]], values: dict[Key, dict[str, float | None]]
) -> None:
    """Blocks and tokens per block from info metrics' labels, for the rows of their target
    (and model, where the info names one)."""
    by_target: dict[tuple[str, str], list[Key]] = {}
    for key in values:
        by_target.setdefault(key[:2], []).append(key)
    for engine in ENGINES:
        spec = engine.capacity
        for series in answers.get(f"info:{engine.name}", ()):
            labels = series.labels
            model = labels.get(engine.model_label or "", "")
            target = (labels.get("job", ""), labels.get("instance", ""))
            for key in by_target.get(target, ()):
                if not model or key[2] == model:
                    values[key]["block_tokens"] = _number(labels.get(spec.block_size_label or ""))
                    values[key]["blocks"] = _number(labels.get(spec.blocks_label or ""))


def _number(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def _alerts(series: Sequence[Series]) -> dict[str, tuple[Alert, ...]]:
    """Firing alerts by the instance they are about."""
    out: dict[str, list[Alert]] = {}
    for s in series:
        labels = s.labels
        severity = SEVERITIES.get(labels.get("severity", ""), "warning")
        alert = Alert(
            name=labels.get("alertname", "?"),
            severity=severity,
            state="firing",
            value=None,
            summary="",
            description="",
            remediation="",
            runbook_url="",
            active_since=0.0,
            labels={k: v for k, v in labels.items() if k not in _NOT_ALERT_LABELS},
        )
        out.setdefault(labels.get("instance", ""), []).append(alert)
    return {key: tuple(value) for key, value in out.items()}


def _url(instance: str) -> str:
    return instance if "://" in instance else f"http://{instance}"


def _figures(engine: str, row: Mapping[str, float | None]) -> tuple[Figures, tuple[str, ...]]:
    """A row's figures from its columns, and the notes of numbers left out as nonsense."""
    preemptions = row.get("preemptions")
    gauge = engine != KVCTL and _engine(engine).prefix.gauge is not None
    return from_source(
        {
            "alloc_success_ratio": row.get("alloc"),
            "fragmentation_ratio": row.get("frag"),
            "utilization_ratio": row.get("util"),
            "pressure_ratio": row.get("pressure"),
            "prefix_hit_ratio": row.get("prefix"),
            "requests_running": row.get("running"),
            "requests_waiting": row.get("waiting"),
            "preemptions": preemptions,
            "capacity_tokens": row.get("tokens"),
            "capacity_bytes": row.get("bytes"),
            "block_tokens": row.get("block_tokens"),
            "blocks": row.get("blocks"),
        },
        prefix_span="engine's own" if gauge else WINDOW,
        preemptions_span=None if preemptions is None else WINDOW,
    )


def _down(job: str, instance: str, alerts: tuple[Alert, ...]) -> Reading:
    agent = _url(instance)
    message = f"{agent}: Prometheus could not scrape it (up == 0, job {job})"
    return unseen(agent, message, "scrape failing (up == 0)", alerts)


def unseen(agent: str, message: str, reason: str, alerts: tuple[Alert, ...] = ()) -> Reading:
    """The row of a node Prometheus has no figures of, saying why."""
    error = AgentUnreachable(agent, message, reason=reason)
    return Reading(agent=agent, source="prometheus", alerts=alerts, error=error)


def read_prometheus_once(
    url: str, selector: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> list[Reading]:
    """A blocking read, for commands that print once and exit."""

    async def read() -> list[Reading]:
        fleet = PrometheusFleet(url, selector, timeout)
        try:
            return await fleet.read()
        finally:
            await fleet.aclose()

    return asyncio.run(read())
