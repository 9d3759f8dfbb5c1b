"""Cost of one `/metrics` render at 100,000 and 1,000,000 pages.

Prometheus scrapes every agent every few seconds, and the scrape runs in the agent's process next
to the engine, so its cost must not grow with the pool. The agent's exporter reads a snapshot
whose pool statistics (free extents, largest free run, fragmentation) the pool keeps
incrementally, so a render costs the same at any size. The baseline, measured in the same run on
the same layout, is a naive exporter that recomputes them each scrape by scanning a per-page
state array with numpy (the array is kept up to date for free here, which flatters it).

Both renders go through the same registry code (`build_registry` + `render`, process metrics
included); only the `snapshot_fn` differs. The layout: random allocate/free of 1..64-page
requests from a seed until a quarter of the pool is free, then half the sequences freed.

Rounds are paired and interleaved (kvctl, naive, naive, kvctl, ...); each round times `--repeat`
renders (and as many bare `snapshot_fn` calls) of each side and keeps the medians. Times are the
median (min-max) over the rounds, the speedup the median (min-max) of the per-round ratios naive
render / kvctl render.

    python benchmarks/metrics_scrape.py [--pages 100000 1000000] [--seed 0] [--rounds 9]
        [--repeat 25]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
from paired import MIN_ROUNDS, command_line, environment, load_average, paired_rounds, spread

from kvctl.agent.api_views import occupancy_fields
from kvctl.agent.observe.metrics import Histograms, build_registry, render
from kvctl.agent.pool import PagePool, PoolOccupancy
from kvctl.api import GpuMemory, PoolSnapshot

BYTES_PER_PAGE = 2 * 32 * 16 * 8 * 128 * 2  # K and V, 32 layers, 16 tokens, 8 heads × 128, bf16
FREE, USED, CACHED = 0, 1, 2


def fragmented_pool(pages: int, seed: int) -> PagePool:
    rng = random.Random(seed)
    pool = PagePool(pages, 1, bytes_per_page=BYTES_PER_PAGE)
    live: list[int] = []
    while pool.free_pages > pages // 4:
        n = rng.randint(1, 64)
        if pool.free_pages < n:
            break
        pool.allocate(len(live), n)
        live.append(len(live))
    rng.shuffle(live)
    for seq in live[: len(live) // 2]:
        pool.free(seq)
    return pool


def snapshot_of(stats: PoolOccupancy) -> PoolSnapshot:
    """What the agent publishes: pool statistics plus counters the engine keeps."""
    return PoolSnapshot(
        **occupancy_fields(stats),
        pool="llama-3-8b",
        timestamp=time.time(),
        device="cuda",
        max_pool_pages=None,
        alloc_success_ratio=1.0,
        window_seconds=300.0,
        prefix_cache_enabled=True,
        prefix_queries_tokens_total=1_000_000,
        prefix_hits_tokens_total=400_000,
        prefix_hit_ratio=0.4,
        prefix_evictions_total=0,
        defrag_runs_total={"threshold": 3},
        defrag_pages_moved_total=12_345,
        defrag_active=False,
        last_defrag=None,
        last_defrag_age_seconds=None,
        auto_defrag_enabled=True,
        resizes_total={},
        requests_running=64,
        requests_waiting=3,
        preemptions_total=0,
        gpus=[GpuMemory(index=0, name="GPU", used_bytes=70 * 2**30, total_bytes=80 * 2**30)],
    )


def scanned_stats(pool: PagePool, states: np.ndarray) -> PoolOccupancy:
    """The naive exporter's statistics: every free run found by scanning the state array."""
    free = states == FREE
    edges = np.flatnonzero(np.diff(np.concatenate(([0], free.view(np.int8), [0]))))
    lengths = edges[1::2] - edges[::2]
    cached = int(np.count_nonzero(states == CACHED))
    free_pages = int(lengths.sum())
    return PoolOccupancy(
        page_size=pool.page_size,
        bytes_per_page=pool.bytes_per_page,
        segment_pages=pool.segment_pages,
        segments=pool.sizing.segments,
        capacity_pages=len(states),
        used_pages=len(states) - free_pages - cached,
        cached_pages=cached,
        free_pages=free_pages,
        free_extents=len(lengths),
        largest_free_run=int(lengths.max()) if len(lengths) else 0,
        sequences=len(pool.sequences()),
        alloc_attempts_total=pool.alloc_attempts,
        alloc_failures_total=pool.alloc_failures,
        contiguous_misses_total=pool.contiguous_misses,
    )


def state_array(pool: PagePool) -> np.ndarray:
    states = np.full(pool.capacity, USED, dtype=np.uint8)
    for start, length in pool.pages.free_runs():
        states[start : start + length] = FREE
    return states


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(pages: int, seed: int, rounds: int, repeat: int) -> None:
    pool = fragmented_pool(pages, seed)
    states = state_array(pool)

    def kvctl_fn() -> PoolSnapshot:
        return snapshot_of(pool.stats())

    def naive_fn() -> PoolSnapshot:
        return snapshot_of(scanned_stats(pool, states))

    assert kvctl_fn().model_dump(exclude={"timestamp"}) == naive_fn().model_dump(
        exclude={"timestamp"}
    )
    histograms = Histograms()
    kvctl_registry = build_registry(kvctl_fn, histograms)
    naive_registry = build_registry(naive_fn, histograms)
    assert len(render(kvctl_registry)[0]) > 0
    render(naive_registry)  # warm-up
    snaps: dict[str, list[float]] = {"kvctl": [], "naive": []}

    def side(name: str, registry: object, snapshot_fn: Callable[[], object]) -> float:
        """One round of one side: renders per second (so kvctl / naive is the speedup)."""
        ms = median_ms(lambda: render(registry), repeat)
        snaps[name].append(median_ms(snapshot_fn, repeat))
        return 1e3 / ms

    paired = paired_rounds(
        lambda: side("kvctl", kvctl_registry, kvctl_fn),
        lambda: side("naive", naive_registry, naive_fn),
        rounds,
    )
    stats = pool.stats()
    print(
        f"{pages:>9,}{stats.free_extents:>9,}{stats.fragmentation_ratio:>7.3f}"
        f"{spread([1e3 / r for r in paired.ours], fmt='.3f'):>22}"
        f"{spread(snaps['kvctl'], fmt='.3f'):>22}"
        f"{spread([1e3 / r for r in paired.base], fmt='.3f'):>22}"
        f"{spread(snaps['naive'], fmt='.3f'):>22}"
        f"{spread(paired.ratios, fmt='.1f') + 'x':>20}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=9, help=f"at least {MIN_ROUNDS}")
    parser.add_argument("--repeat", type=int, default=25, help="calls per side and round")
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: fewer pairs say little")
    print(command_line())
    print(environment())
    print(
        f"ms per call, median (min-max) over {args.rounds} paired rounds of {args.repeat} calls; "
        "'render' is the whole /metrics body, 'snap' the snapshot_fn in it; speedup: per-round "
        "naive render / kvctl render"
    )
    print(
        f"{'pages':>9}{'extents':>9}{'frag':>7}{'kvctl render':>22}{'kvctl snap':>22}"
        f"{'naive render':>22}{'naive snap':>22}{'speedup':>20}"
    )
    for pages in args.pages:
        measure(pages, args.seed, args.rounds, args.repeat)
    print("target: kvctl render under 10 ms at 1,000,000 pages")
    print(load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main())
