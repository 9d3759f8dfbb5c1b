"""Prometheus rule files for the inference engines kvctl reads beside its agents (vLLM, SGLang).

An engine has no kvctl agent to evaluate and push its alerts, so Prometheus raises them all,
from the engine's own /metrics. Each alert is one concept (`EngineAlert`: KV cache pressure,
a preemption storm, the prefix cache's hit rate, queue growth, the server down or absent) with
what every engine shares: severity, `for`, the meaning. Its expression is built from the
engine's metric names in `kvctl.engines`, so a name is spelled in one place, and an
`EngineProfile` adds what differs: the knobs a remediation names and what the engine's figure
does not say. Thresholds are the `AlertSettings` fields of the same concept in kvctl's own
alerts, so `pressure_high` means the same share for every engine. The alerts render through
`kvctl.alerts.rules` as `RuleOnlyAlert`s, with the same templates and YAML.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from string import Formatter

from kvctl.alerts.catalog import RULES_RUNBOOK_BASE
from kvctl.alerts.definition import RuleOnlyAlert, Severity
from kvctl.alerts.rules import alert_rule, dump
from kvctl.api import AlertSettings
from kvctl.engines import SGLANG, VLLM, Engine

WINDOW = "5m"
"""The span rates and gauges are read over, as in kvctl's recording rules."""
PREFIX_QUERY_TOKENS_MIN_PER_S = 100
"""A hit rate from counters needs this many prompt tokens looked up per second behind it (a few
prompts a minute), so an idle node or a lone health check does not read as a collapse."""
PREFIX_RUNNING_MIN = 1
"""A hit-rate gauge is trusted while at least this many requests ran on average: an engine that
exports no query counter has no better sign of traffic."""

SERIES_LABELS = ("job", "instance", "model_name")
"""The labels an alert on an engine's series keeps (the engine's own, such as SGLang's
`tp_rank`, pass through too)."""
PLACEHOLDERS = ("title", "engine", "alerts", "preempted")
"""Words of an engine filled into a concept's texts before they become templates."""


@dataclass(frozen=True)
class EngineProfile:
    """What a rule file says of one engine beyond its metric names."""

    engine: Engine
    preempted: str
    """How the engine calls a request it evicts to free KV memory ("preempted")."""
    remediation: Mapping[str, str]
    """By concept: what to change, naming the engine's own knobs."""
    notes: Mapping[str, str] = field(default_factory=dict)
    """By concept: what the engine's figure does not say, appended to the description."""
    knobs: tuple[str, ...] = ()
    """Every flag of the engine a remediation may name."""
    traffic: str = ""
    """How the prefix alert knows there is traffic to measure, for the file's header."""

    @property
    def prefix(self) -> str:
        return self.engine.alert_prefix

    @property
    def words(self) -> dict[str, str]:
        return {
            "title": self.engine.title,
            "engine": self.engine.name,
            "alerts": self.prefix,
            "preempted": self.preempted,
        }


@dataclass(frozen=True)
class EngineAlert:
    """One alert concept, rendered for every engine of `PROFILES`.

    `expr` builds the expression template (as `RuleOnlyAlert.expr`: `{job}` and the
    `AlertSettings` fields) from the engine's metric names. Texts are templates as a
    `RuleOnlyAlert`'s, with the engine's words of `PLACEHOLDERS` (`{title}`...) filled in first;
    `remediation` is the engine's own unless the profile has none for the concept.
    """

    concept: str
    severity: Severity
    expr: Callable[[EngineProfile], str]
    summary: str
    description: str
    remediation: str = ""
    for_scale: float = 1.0
    value_format: str = "count"
    labels: tuple[str, ...] = SERIES_LABELS
    """The labels the expression keeps, which the texts may name."""

    def name(self, profile: EngineProfile) -> str:
        return profile.prefix + self.concept

    def for_engine(self, profile: EngineProfile) -> RuleOnlyAlert:
        note = profile.notes.get(self.concept)
        description = f"{self.description}. {note}" if note else self.description
        return RuleOnlyAlert(
            name=self.name(profile),
            severity=self.severity,
            expr=self.expr(profile),
            summary=_fill(self.summary, profile),
            description=_fill(description, profile),
            remediation=_fill(profile.remediation.get(self.concept, self.remediation), profile),
            for_scale=self.for_scale,
            value_format=self.value_format,
        )


def _fill(template: str, profile: EngineProfile) -> str:
    """`template` with the engine's words in place; every other field left for `go_template`."""
    out = []
    for literal, name, _, _ in Formatter().parse(template):
        out.append(literal.replace("{", "{{").replace("}", "}}"))
        if name is not None:
            out.append(profile.words[name] if name in PLACEHOLDERS else "{" + name + "}")
    return "".join(out)


def _series(metric: str | None) -> str:
    """The engine's `metric` scraped by the rule file's job, as an expression template."""
    if metric is None:
        raise ValueError("the engine exports no metric for this alert")
    return metric + '{{job="{job}"}}'


def _rate(metric: str | None) -> str:
    return f"rate({_series(metric)}[{WINDOW}])"


def _storm(engine: Engine) -> str:
    """Preemptions per minute over the window above the storm threshold."""
    return f"{_rate(engine.preemptions)} * 60 > {{preemptions_per_minute_max}}"


def _pressure(profile: EngineProfile) -> str:
    return f"{_series(profile.engine.utilization)} > {{pressure_high}}"


def _preemptions(profile: EngineProfile) -> str:
    return _storm(profile.engine)


def _prefix_hits(profile: EngineProfile) -> str:
    """From counters: hits ÷ queries over the window, with traffic behind it; from a gauge
    (each reading one prefill batch's rate), its best reading over the window while requests
    ran. Either stands down while the window holds a preemption storm, which evicts cached
    prefixes (and inflated hits in older vLLM): the storm is the alert to act on then."""
    e = profile.engine
    if e.prefix.hits and e.prefix.queries:
        low = [
            f"{_rate(e.prefix.hits)} / {_rate(e.prefix.queries)} < {{prefix_hit_min}}",
            f"and {_rate(e.prefix.queries)} >= {PREFIX_QUERY_TOKENS_MIN_PER_S}",
        ]
    else:
        low = [
            f"max_over_time({_series(e.prefix.gauge)}[{WINDOW}]) < {{prefix_hit_min}}",
            f"and avg_over_time({_series(e.running)}[{WINDOW}]) >= {PREFIX_RUNNING_MIN}",
        ]
    return "\n".join(["(", *(f"  {line}" for line in low), ")", f"unless {_storm(e)}"])


def _queue(profile: EngineProfile) -> str:
    """Requests wait at every scrape of the window, and the queue grows or is longer than
    what runs; the value is the queue now."""
    waiting, running = _series(profile.engine.waiting), _series(profile.engine.running)
    return (
        f"{waiting}\nand min_over_time({waiting}[{WINDOW}]) > 0\n"
        f"and (deriv({waiting}[{WINDOW}]) > 0 or {waiting} > {running})"
    )


def _down(_: EngineProfile) -> str:
    return 'up{{job="{job}"}} == 0'


def _absent(_: EngineProfile) -> str:
    return 'absent(up{{job="{job}"}})'


ALERTS: tuple[EngineAlert, ...] = (
    EngineAlert(
        concept="KvCachePressureHigh",
        severity="warning",
        expr=_pressure,
        summary="The {title} KV cache of {model_name} at {instance} is nearly full",
        description=(
            "running requests hold {value} of the KV cache, more than {pressure_high}, for "
            "a while: new requests will wait and running ones be {preempted} next. Likely "
            "cause: more concurrent sequences, or longer ones, than the cache holds"
        ),
        for_scale=5.0,
        value_format="percent",
    ),
    EngineAlert(
        concept="PreemptionStorm",
        severity="warning",
        expr=_preemptions,
        summary="Requests of {model_name} at {title} {instance} are {preempted} over and over",
        description=(
            "{value} requests a minute (5-minute average) are {preempted} to free KV memory, "
            "more than {preemptions_per_minute_max}: their cache is dropped and their tokens "
            "computed again when they are readmitted, so throughput drops and latency grows. "
            "Likely cause: the scheduler admitted more sequences than the KV cache holds once "
            "they decode"
        ),
        value_format="rate",
    ),
    EngineAlert(
        concept="PrefixHitRateLow",
        severity="info",
        expr=_prefix_hits,
        summary="The {title} prefix cache of {model_name} at {instance} rarely hits",
        description=(
            "the prefix cache found {value} of the prompt tokens looked up, less than "
            "{prefix_hit_min}, while there was traffic to measure: each miss is a prefill "
            "that could have been skipped. Likely causes: the cache evicts prefixes before "
            "they are reused (it is full), prompts share no identical prefix (a timestamp or "
            "a changed system prompt first), or requests with one prefix are spread over "
            "replicas. The alert stands down while more than {preemptions_per_minute_max} "
            "requests a minute are {preempted} over the same 5 minutes: a storm evicts cached "
            "prefixes, so a low rate then is its doing and {alerts}PreemptionStorm the alert "
            "to act on; a resolve then is no recovery"
        ),
        for_scale=10.0,
        value_format="percent",
    ),
    EngineAlert(
        concept="QueueGrowing",
        severity="warning",
        expr=_queue,
        summary="Requests to {model_name} queue up at {title} {instance}",
        description=(
            "{value} requests wait: the queue has not emptied for 5 minutes, and it grows or "
            "holds more requests than run. The engine admits waiting requests at every step "
            "while it has room, so a queue that stays means running requests are at their "
            "ceiling. Likely cause: more traffic than the replica serves"
        ),
    ),
    EngineAlert(
        concept="EngineDown",
        severity="critical",
        expr=_down,
        summary="{title} at {instance} is down",
        description=(
            "Prometheus cannot scrape the {title} server at {instance} (job {job}): it is "
            "stopped, crashed, still loading its model, or unreachable, so it answers no "
            "request and its other alerts are silent"
        ),
        labels=("job", "instance"),
    ),
    EngineAlert(
        concept="EngineAbsent",
        severity="warning",
        expr=_absent,
        summary="Prometheus scrapes no {title} server of job {job}",
        description=(
            "no target of job {job} exists: service discovery finds no {title} server, or "
            "the scrape config names its job otherwise, so no {title} alert can fire"
        ),
        remediation=(
            "Check the targets of job {job} on Prometheus' /targets page and the `job_name` "
            "of the scrape config (or the ServiceMonitor); for another job name generate the "
            "file with `kvctl alerts rules --engine {engine} --job NAME`"
        ),
        for_scale=5.0,
        labels=("job",),
    ),
)

VLLM_PROFILE = EngineProfile(
    engine=VLLM,
    preempted="preempted",
    knobs=(
        "--gpu-memory-utilization",
        "--kv-cache-memory-bytes",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--max-model-len",
    ),
    traffic=f"at least {PREFIX_QUERY_TOKENS_MIN_PER_S} prompt tokens looked up per second",
    notes={
        "KvCachePressureHigh": (
            "vllm:kv_cache_usage_perc counts cached prefix blocks that no request uses as "
            "free (they are reclaimable), so it is the share running requests hold, as "
            "kvctl's pressure is; a node full of reusable prefixes reads low, not full, and "
            "clearing the prefix cache (`kvctl --agent vllm+http://{instance} prefix clear`) "
            "frees none of it"
        ),
        "PreemptionStorm": (
            "vLLM releases before the fix of vLLM issue 25780 count the recomputed tokens of "
            "preempted requests as prefix hits, so their hit rate reads good meanwhile; "
            "VllmPrefixHitRateLow stands down during a storm either way"
        ),
        "PrefixHitRateLow": (
            "The rate is hits over queries of the last 5 minutes, with at least "
            f"{PREFIX_QUERY_TOKENS_MIN_PER_S} prompt tokens looked up per second. vLLM "
            "releases before the fix of vLLM issue 25780 count the recomputed tokens of "
            "preempted requests as hits, so a storm reads as a good rate there; later ones "
            "count a request at its first admission only"
        ),
        "QueueGrowing": (
            "Running requests stop at `--max-num-seqs`, or when the KV cache has no block "
            "left (VllmKvCachePressureHigh then)"
        ),
    },
    remediation={
        "KvCachePressureHigh": (
            "Give the KV cache more memory: raise `--gpu-memory-utilization` (e.g. 0.9 → "
            "0.95, if nothing else uses the GPU) or set `--kv-cache-memory-bytes`; or run "
            "fewer sequences at once with a lower `--max-num-seqs`; keep "
            "`--enable-prefix-caching` on so requests with a common prefix share blocks; add "
            "replicas of {model_name} if the load stays"
        ),
        "PreemptionStorm": (
            "Run fewer sequences at once: lower `--max-num-seqs`, and `--max-num-batched-tokens`"
            " (the tokens one step schedules); or give the KV cache more memory with "
            "`--gpu-memory-utilization` or `--kv-cache-memory-bytes`"
        ),
        "PrefixHitRateLow": (
            "Check that prefix caching is on (`--enable-prefix-caching`, not "
            "`--no-enable-prefix-caching`) and that prompts start with the same text (system "
            "prompt first, no timestamp before it); keep prefixes cached longer with more KV "
            "memory (`--gpu-memory-utilization`, `--kv-cache-memory-bytes`); route requests "
            "with one prefix to one replica"
        ),
        "QueueGrowing": (
            "Add replicas of {model_name}; while the KV cache has room (no "
            "VllmKvCachePressureHigh) raise `--max-num-seqs`, otherwise give it more memory "
            "(`--gpu-memory-utilization`, `--kv-cache-memory-bytes`); a larger "
            "`--max-num-batched-tokens` admits long prompts sooner"
        ),
        "EngineDown": (
            "Read the server's log (`kubectl logs POD`, `journalctl -u vllm`): an out-of-memory "
            "at start wants a lower `--gpu-memory-utilization` (another process holds GPU "
            'memory), "no available memory for the cache blocks" a higher one or a smaller '
            "`--max-model-len`; once it runs, `curl http://{instance}/metrics` answers"
        ),
    },
)

SGLANG_PROFILE = EngineProfile(
    engine=SGLANG,
    preempted="retracted",
    knobs=(
        "--mem-fraction-static",
        "--max-running-requests",
        "--schedule-conservativeness",
        "--disable-radix-cache",
        "--schedule-policy",
        "--chunked-prefill-size",
        "--enable-metrics",
    ),
    traffic=f"at least {PREFIX_RUNNING_MIN} request running on average",
    notes={
        "KvCachePressureHigh": (
            "sglang:token_usage counts the radix cache's evictable tokens as free, so it is "
            "the share running requests hold, as kvctl's pressure is, and flushing the cache "
            "(`kvctl --agent sglang+http://{instance} prefix clear`) frees none of it"
        ),
        "PreemptionStorm": (
            "SGLang frees a retracted request's KV without caching it and evicts radix-cache "
            "tokens to make room, so a storm can lower the prefix hit rate too; "
            "SglangPrefixHitRateLow stands down meanwhile"
        ),
        "PrefixHitRateLow": (
            "sglang:cache_hit_rate is the hit rate of the latest prefill batch, not a ratio "
            "of counters, and SGLang writes 0 into it when it logs decode batches, so the "
            "value is the best reading of the last 5 minutes (every one was lower), taken "
            f"while at least {PREFIX_RUNNING_MIN} request ran on average; re-prefills of "
            "retracted requests are left out of it"
        ),
        "QueueGrowing": (
            "Running requests stop at `--max-running-requests`, or when the KV pool has no "
            "room (SglangKvCachePressureHigh then)"
        ),
    },
    remediation={
        "KvCachePressureHigh": (
            "Give the KV pool more memory: raise `--mem-fraction-static` (e.g. 0.85 → 0.9, if "
            "activations still fit); or run fewer requests at once with a lower "
            "`--max-running-requests`; keep the radix cache on (no `--disable-radix-cache`) "
            "so requests with a common prefix share tokens; add replicas of {model_name} if "
            "the load stays"
        ),
        "PreemptionStorm": (
            "Make the scheduler keep more room for decoding: raise "
            "`--schedule-conservativeness` (e.g. 1.0 → 1.3); or cap `--max-running-requests`;"
            " or give the KV pool more memory with `--mem-fraction-static`"
        ),
        "PrefixHitRateLow": (
            "Check that the radix cache is on (`--disable-radix-cache` must not be set) and "
            "that prompts start with the same text (system prompt first, no timestamp before "
            "it); `--schedule-policy lpm` runs requests with the longest cached prefix first; "
            "keep prefixes cached longer with more memory (`--mem-fraction-static`); route "
            "requests with one prefix to one replica"
        ),
        "QueueGrowing": (
            "Add replicas of {model_name}; while the KV pool has room (no "
            "SglangKvCachePressureHigh) raise `--max-running-requests` or lower "
            "`--schedule-conservativeness` (e.g. 1.0 → 0.8) to admit more, otherwise raise "
            "`--mem-fraction-static`; a larger `--chunked-prefill-size` admits long prompts "
            "sooner"
        ),
        "EngineDown": (
            "Read the server's log (`kubectl logs POD`, `journalctl -u sglang`): an "
            "out-of-memory at start or in CUDA graph capture wants a lower "
            "`--mem-fraction-static`; SGLang serves /metrics only with `--enable-metrics` "
            "(without it the scrape fails with 404); once it runs, "
            "`curl http://{instance}/metrics` answers"
        ),
    },
)

PROFILES: dict[str, EngineProfile] = {p.engine.name: p for p in (VLLM_PROFILE, SGLANG_PROFILE)}
"""The engines with a rule file, by name."""

HEADER = """\
# Prometheus alerts for {title} servers, from kvctl's alert catalog: KV cache pressure,
# preemption storms, the prefix cache's hit rate, queue growth, the server down or absent.
# Metric names are {title} {version}'s (kvctl/engines.py); alerts keep their model_name label.
# Generated by `kvctl alerts rules --engine {engine}`; regenerate rather than edit (a test keeps
# them equal). Thresholds are kvctl's alert settings of the same names, so a number means the
# same for every engine (`--set alerts.NAME=VALUE` for yours); this file was generated with
#   {settings}
# Rates are over {window}; the prefix hit rate needs {traffic}.
# The alerts expect the servers' scrape job to be named "{job}" (`--job NAME` for another);
# their runbook links start with {runbook}
# (`--runbook-url URL` for where you serve docs/alerts.md; every kvctl agent serves it at
# /runbook).
"""


def engine_alerts(engine: str) -> tuple[RuleOnlyAlert, ...]:
    """The alerts of the engine called `engine`, in the file's order."""
    profile = _profile(engine)
    return tuple(alert.for_engine(profile) for alert in ALERTS)


def settings_read(engine: str) -> tuple[str, ...]:
    """The `AlertSettings` fields the engine's rule file is generated with, in their order."""
    used = {"for_s"}
    for alert in engine_alerts(engine):
        for template in (alert.expr, alert.summary, alert.description, alert.remediation):
            used |= {name for _, name, _, _ in Formatter().parse(template) if name}
    return tuple(name for name in AlertSettings.model_fields if name in used)


def render_engine_rule_file(
    engine: str,
    settings: AlertSettings | None = None,
    *,
    runbook_base: str = RULES_RUNBOOK_BASE,
    job: str | None = None,
) -> str:
    """The rule file of `engine` ("vllm", "sglang") for `settings` (kvctl's defaults when
    None), as YAML text; `job` is the servers' scrape job, the engine's name by default."""
    profile = _profile(engine)
    settings = settings or AlertSettings()
    job = job or profile.engine.name
    rules = [alert_rule(alert, settings, runbook_base, job) for alert in engine_alerts(engine)]
    values = " ".join(f"alerts.{n}={getattr(settings, n):g}" for n in settings_read(engine))
    header = HEADER.format(
        title=profile.engine.title,
        version=profile.engine.version,
        engine=profile.engine.name,
        settings=values,
        window=WINDOW,
        traffic=profile.traffic,
        job=job,
        runbook=runbook_base,
    )
    return header + dump({"groups": [{"name": f"kvctl-{profile.engine.name}", "rules": rules}]})


def _profile(engine: str) -> EngineProfile:
    try:
        return PROFILES[engine]
    except KeyError:
        known = ", ".join(PROFILES)
        raise ValueError(f"no rule file for engine {engine!r}: expected one of {known}") from None
