"""The inference engines kvctl reads beside its own agents, and what each one's /metrics says.

One definition per engine: the metric names behind every fleet column (None where the engine
exports nothing for it, which the views show as "–", never as a guess), the label that names a
model, how the engine is recognised in an exposition, its knobs an alert's remedy names, and the
pitfalls of its figures that an operator must know before trusting them. The exposition reader
(`kvctl.exposition`), the Prometheus fleet source (`kvctl.prometheus_fleet`) and the engine rule
files (`kvctl.alerts.engine_rules`) all read this table, so a name is spelled in one place.

Names are those of the versions the recorded expositions in tests/fixtures/expositions came
from; each engine's `version` says which.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixHits:
    """How an engine reports prefix-cache reuse: a pair of token counters (hits, queries), whose
    ratio over a window is the hit rate, or a gauge that already is one."""

    hits: str | None = None
    queries: str | None = None
    gauge: str | None = None


@dataclass(frozen=True)
class Capacity:
    """How an engine reports its KV capacity: blocks and tokens per block from an info metric's
    labels, or from gauges; `tokens` where it reports a token count instead."""

    info: str | None = None
    block_size_label: str | None = None
    blocks_label: str | None = None
    block_size: str | None = None
    blocks: str | None = None
    tokens: str | None = None


@dataclass(frozen=True)
class Engine:
    """One engine's metric vocabulary. Every metric name is as exposed (counters with their
    `_total`)."""

    name: str
    """The scheme prefix in `--agent NAME+http://...` and the `engine` a row shows."""
    title: str
    version: str
    """The version whose exposition the names were checked against."""
    marker: str
    """A metric every exposition of this engine carries: how it is recognised."""
    model_label: str | None
    """The label that names the model served (one row per value), if any."""
    utilization: str | None
    """KV cache in use, 0..1."""
    waiting: str | None
    running: str | None
    preemptions: str | None
    """A counter of requests preempted (or retracted) to free KV memory."""
    prefix: PrefixHits
    capacity: Capacity
    pitfalls: tuple[str, ...] = ()
    """What its figures do not say, in the words a row's detail shows."""
    metrics_path: str = "/metrics"
    """Where it serves the Prometheus text."""

    @property
    def alert_prefix(self) -> str:
        """The start of the names of its alerts in the rule files: "Vllm", "Sglang"."""
        return self.name.capitalize()

    @property
    def series(self) -> frozenset[str]:
        """Every series name its figures are read from: what a reader of its exposition keeps."""
        prefix, capacity = self.prefix, self.capacity
        names = (
            self.marker,
            self.utilization,
            self.waiting,
            self.running,
            self.preemptions,
            prefix.hits,
            prefix.queries,
            prefix.gauge,
            capacity.info,
            capacity.block_size,
            capacity.blocks,
            capacity.tokens,
        )
        return frozenset(name for name in names if name)

    def exports(self, headline: str) -> bool:
        """Whether it exports the figure of a headline ("alloc success", "fragmentation",
        "utilisation", "prefix hits") or "preemptions": an absent figure of one it exports
        means nothing was measured, of one it does not, that there is nothing to show."""
        return {
            "utilisation": self.utilization is not None,
            "prefix hits": self.prefix != PrefixHits(),
            "preemptions": self.preemptions is not None,
        }.get(headline, False)


VLLM = Engine(
    name="vllm",
    title="vLLM",
    version="0.32.0",
    marker="vllm:num_requests_running",
    model_label="model_name",
    utilization="vllm:kv_cache_usage_perc",
    waiting="vllm:num_requests_waiting",
    running="vllm:num_requests_running",
    preemptions="vllm:num_preemptions_total",
    prefix=PrefixHits(
        hits="vllm:prefix_cache_hits_total", queries="vllm:prefix_cache_queries_total"
    ),
    capacity=Capacity(
        info="vllm:cache_config_info", block_size_label="block_size", blocks_label="num_gpu_blocks"
    ),
    pitfalls=(
        # vllm/v1/core/block_pool.py BlockPool.get_usage: 1 - free / (num_gpu_blocks - 1), and
        # BlockPool.free_blocks puts a cached block whose ref_cnt reaches 0 on the free queue,
        # evicted only when get_new_blocks pops it.
        "utilisation counts cached prefix blocks no request holds as free (they are evicted "
        "only when a block is needed), so it reads low on a node full of reusable prefixes; "
        "it is the share of blocks held by requests",
        # vllm/v1/metrics/stats.py PrefixCacheStats.record: a request with num_preemptions > 0
        # goes to preempted_* fields, which no metric exports (vllm/v1/metrics/loggers.py
        # PrometheusStatLogger.record incs queries/hits only); the fix for vLLM issue 25780.
        # vllm/v1/core/kv_cache_manager.py get_computed_blocks: full blocks only, at most
        # num_tokens - 1.
        "prefix hits and queries count a request at its first admission only: a preempted "
        "request recomputed after readmission is in neither, so a preemption storm does not "
        "show in the hit rate (watch preemptions); hits are whole blocks and never a "
        "prompt's last token, so a fully cached prompt reads below 100%",
    ),
)

SGLANG = Engine(
    name="sglang",
    title="SGLang",
    version="0.5.23",
    # sglang/srt/managers/scheduler.py Scheduler.__init__ -> emit_metrics_constants sets it at
    # start; the scheduler gauges (num_running_reqs...) appear only at the first batch or the
    # first idle report, up to 30 s later (MetricsReporter._maybe_log_idle_metrics), and a
    # multiprocess exposition leaves out a series never set.
    marker="sglang:max_total_num_tokens",
    model_label="model_name",
    utilization="sglang:token_usage",
    waiting="sglang:num_queue_reqs",
    running="sglang:num_running_reqs",
    # Not in 0.5.6, whose only retraction figure is the per-interval gauge num_retracted_reqs.
    preemptions="sglang:num_retracted_requests_total",
    prefix=PrefixHits(gauge="sglang:cache_hit_rate"),
    capacity=Capacity(tokens="sglang:max_total_num_tokens"),
    pitfalls=(
        # sglang/srt/managers/scheduler_components/metrics_reporter.py report_prefill_stats:
        # cache_hit_rate = hit / (input + hit) tokens of the batch being reported.
        "the prefix hit rate is a gauge of the latest prefill batch alone (re-prefills of "
        "retracted requests left out), not a ratio of counters, so it cannot be taken over a "
        "chosen window; sglang:prefill_effective_tokens_total (hit modes over all) can",
        # sglang/srt/managers/scheduler_components/pool_stats_observer.py: used = total -
        # (available + evictable); update_scheduler_stats rounds token_usage to 2 places.
        "token usage counts evictable radix-cache tokens as free and is rounded to two "
        "decimals, so it reads low on a node full of reusable prefixes",
    ),
)

TRTLLM = Engine(
    name="trtllm",
    title="TensorRT-LLM",
    # No release yet: these names came with NVIDIA/TensorRT-LLM PR 12545 (after 1.2.0); read at
    # main commit 050f80def8df236e326949c8bd9dee10fd896a83, tensorrt_llm/metrics/collector.py.
    version="main@050f80de",
    # tensorrt_llm/serve/openai_server.py _log_config_info_metrics sets it at start; the KV
    # and queue gauges exist only once iteration stats were logged (enable_iter_perf_stats).
    marker="trtllm_model_config_info",
    model_label="model_name",
    utilization="trtllm_kv_cache_utilization",
    waiting="trtllm_num_requests_waiting",
    running="trtllm_num_requests_running",
    preemptions=None,
    prefix=PrefixHits(gauge="trtllm_kv_cache_hit_rate"),
    capacity=Capacity(
        block_size="trtllm_kv_cache_tokens_per_block", blocks="trtllm_kv_cache_max_blocks"
    ),
    pitfalls=(
        "it exports no preemption count (trtllm_num_paused_requests is a gauge of requests "
        "paused now)",
        # openai_server.py register_routes: /metrics -> get_iteration_stats (JSON);
        # mount_metrics (only with return_perf_metrics) -> /prometheus/metrics.
        "trtllm-serve answers /metrics with JSON; its Prometheus text (read here) is "
        "/prometheus/metrics, served only with return_perf_metrics: true, and the KV, queue "
        "and block figures also need enable_iter_perf_stats: true",
        "the prefix hit rate is the engine's own figure (kvCacheStats.cacheHitRate), not a "
        "ratio of counters, so it cannot be taken over a chosen window",
    ),
    metrics_path="/prometheus/metrics",
)

ENGINES: tuple[Engine, ...] = (VLLM, SGLANG, TRTLLM)
METRICS_PATHS = tuple(dict.fromkeys(engine.metrics_path for engine in ENGINES))
"""Where to look for an engine's exposition, in order, when nothing says which it is."""
BY_NAME = {engine.name: engine for engine in ENGINES}

KVCTL = "kvctl"
"""The `engine` of a kvctl agent's row."""
KVCTL_MARKER = "kvctl_pool_capacity_pages"
READ_SERIES = frozenset({KVCTL_MARKER}).union(*(engine.series for engine in ENGINES))
"""The series an exposition is read for; the rest of it is dropped as it is parsed."""


def split_engine(text: str) -> tuple[str | None, str]:
    """`vllm+http://node:8000` as ("vllm", "http://node:8000"); any other text as (None, it).
    A ValueError, one line, names the engines known for a prefix that is none of them."""
    head, plus, rest = text.strip().partition("+")
    if not plus or "://" not in rest or "://" in head:
        return None, text
    name = head.lower()
    if name != KVCTL:
        engine_named(name)
    return name, rest


def engine_named(name: str) -> Engine:
    """The engine called `name`; a one-line error naming those known otherwise."""
    try:
        return BY_NAME[name]
    except KeyError:
        known = ", ".join([KVCTL, *BY_NAME])
        raise ValueError(f"unknown engine {name!r}: expected one of {known}") from None
