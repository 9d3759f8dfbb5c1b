"""The metric families the project promises (docs/metrics.md lists them with more): what the
exporter must serve and what dashboards and rules may rely on."""

PROMISED_METRICS = frozenset(
    {
        "kvctl_pool_capacity_pages",
        "kvctl_pool_used_pages",
        "kvctl_pool_cached_pages",
        "kvctl_pool_free_pages",
        "kvctl_pool_capacity_bytes",
        "kvctl_pool_used_bytes",
        "kvctl_pool_utilization_ratio",
        "kvctl_pool_fragmentation_ratio",
        "kvctl_pool_free_extents",
        "kvctl_alloc_attempts_total",
        "kvctl_alloc_failures_total",
        "kvctl_alloc_success_ratio",
        "kvctl_prefix_cache_queries_tokens_total",
        "kvctl_prefix_cache_hits_tokens_total",
        "kvctl_prefix_cache_hit_ratio",
        "kvctl_defrag_runs_total",
        "kvctl_defrag_pages_moved_total",
        "kvctl_defrag_duration_seconds",
        "kvctl_pool_resizes_total",
        "kvctl_requests_running",
        "kvctl_requests_waiting",
        "kvctl_preemptions_total",
        "kvctl_gpu_memory_used_bytes",
        "kvctl_gpu_memory_total_bytes",
        "kvctl_kv_tier_capacity_bytes",
        "kvctl_kv_tier_used_bytes",
        "kvctl_kv_tier_stored_pages_total",
        "kvctl_kv_tier_stored_bytes_total",
        "kvctl_kv_tier_loaded_pages_total",
        "kvctl_kv_tier_loaded_bytes_total",
        "kvctl_kv_tier_store_seconds_total",
        "kvctl_kv_tier_load_seconds_total",
        "kvctl_kv_tier_evicted_pages_total",
        "kvctl_kv_tier_store_failures_total",
        "kvctl_kv_tier_load_failures_total",
        "kvctl_kv_tier_filesystem_free_bytes",
        "kvctl_kv_tier_filesystem_size_bytes",
        "kvctl_prefill_seconds_per_token",
    }
)
TIERED = frozenset({"kvctl_prefix_cache_hits_tokens_total"})
"""Families with a `tier` label beside the per-tier `kvctl_kv_tier_*` ones: a query must keep
`tier` or sum it away, never divide the series by an untiered one."""
HISTOGRAMS = frozenset({"kvctl_defrag_duration_seconds"})


def series_names(families: frozenset[str] = PROMISED_METRICS) -> set[str]:
    """Names as they appear in queries: a histogram is its _bucket, _sum and _count series."""
    names = set(families - HISTOGRAMS)
    for histogram in families & HISTOGRAMS:
        names |= {f"{histogram}_bucket", f"{histogram}_sum", f"{histogram}_count"}
    return names
