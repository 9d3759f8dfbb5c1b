"""Cost of the fragmentation statistics on a 1,000,000-page pool.

Metrics are scraped every few seconds, so reading the pool's fragmentation ratio, free extents
and largest free run must stay cheap at any pool size. The pool keeps its free space as extents
in size classes, so the statistics are read, not computed. The baseline is the on-demand
computation over a page-state array with numpy (find every free run with `np.diff`), done on
the same layout in the same run.

Layouts: `random` (random allocate/free of 1..64-page requests until half the pool is free),
`checkerboard` (every other page free: 500,000 extents), and `large-runs` (free runs of 64..127
pages, all in the top size class, the worst case for reading the largest run). `first ms` is the
first read after the layout was built: it also settles the short runs freed last, whose
coalescing the pool defers (at most 256 runs), so it is the worst case of a read.

Rounds are paired and interleaved (kvctl, numpy, numpy, kvctl, ...); each round times `--repeat`
reads of each side and keeps the median. Times are the median (min-max) over the rounds, and the
speedup the median (min-max) of the per-round ratios numpy ms / kvctl ms.

    python benchmarks/fragmentation_stats.py [--pages 1000000] [--seed 0] [--rounds 9]
        [--repeat 20]
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

from kvctl.agent.pool import PagePool
from kvctl.agent.pool.stats import PageState


def random_layout(pages: int, seed: int) -> PagePool:
    rng = random.Random(seed)
    pool = PagePool(pages, 1)
    live: list[int] = []
    next_id = 0
    while pool.free_pages > pages // 4:
        n = rng.randint(1, 64)
        if pool.free_pages < n:
            break
        pool.allocate(next_id, n)
        live.append(next_id)
        next_id += 1
    rng.shuffle(live)
    for seq in live[: len(live) // 2]:
        pool.free(seq)
    return pool


def checkerboard_layout(pages: int) -> PagePool:
    pool = PagePool(pages, 1)
    for i in range(pages):
        pool.allocate(i, 1)
    for i in range(0, pages, 2):
        pool.free(i)
    return pool


def large_runs_layout(pages: int, seed: int) -> PagePool:
    rng = random.Random(seed)
    pool = PagePool(pages, 1)
    seq = 0
    while pool.free_pages > 200:
        gap = rng.randint(64, 127)
        if pool.free_pages < gap + 1:
            break
        pool.allocate(("gap", seq), gap)
        pool.allocate(("keep", seq), 1)
        seq += 1
    pool.allocate("tail", pool.free_pages)  # so the top size class holds every free run
    for i in range(seq):
        pool.free(("gap", i))
    return pool


def numpy_stats(free_mask: np.ndarray) -> tuple[int, int, float]:
    """Free extents, largest free run and fragmentation ratio from a page-state array."""
    padded = np.concatenate(([0], free_mask.view(np.int8), [0]))
    edges = np.flatnonzero(np.diff(padded))
    lengths = edges[1::2] - edges[::2]
    free = int(lengths.sum())
    largest = int(lengths.max()) if len(lengths) else 0
    return len(lengths), largest, (1 - largest / free) if free else 0.0


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=9, help=f"at least {MIN_ROUNDS}")
    parser.add_argument("--repeat", type=int, default=20, help="reads per side and round")
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: fewer pairs say little")
    print(command_line())
    print(environment())
    layouts = {
        "random": lambda: random_layout(args.pages, args.seed),
        "checkerboard": lambda: checkerboard_layout(args.pages),
        "large-runs": lambda: large_runs_layout(args.pages, args.seed),
    }
    print(
        f"{args.rounds} paired rounds of {args.repeat} reads a side; "
        "ms: median (min-max) over rounds; speedup: median (min-max) of per-round numpy/kvctl"
    )
    print(
        f"{'layout':<13}{'extents':>9}{'frag':>7}{'first ms':>10}{'kvctl ms':>24}"
        f"{'numpy ms':>22}{'speedup':>22}"
    )
    for name, build in layouts.items():
        pool = build()
        mask = np.array([pool.pages.state(p) is PageState.FREE for p in range(pool.capacity)])
        first = median_seconds(pool.stats, 1)
        # rates (reads per second), so that the per-round ratio kvctl / numpy is the speedup
        paired = paired_rounds(
            lambda pool=pool: 1 / median_seconds(pool.stats, args.repeat),
            lambda m=mask: 1 / median_seconds(lambda: numpy_stats(m), args.repeat),
            args.rounds,
        )
        stats = pool.stats()
        extents, largest, frag = numpy_stats(mask)
        assert (extents, largest) == (stats.free_extents, stats.largest_free_run)
        assert abs(frag - stats.fragmentation_ratio) < 1e-12
        ours_ms = [1e3 / r for r in paired.ours]
        base_ms = [1e3 / r for r in paired.base]
        print(
            f"{name:<13}{stats.free_extents:>9}{stats.fragmentation_ratio:>7.3f}"
            f"{first * 1e3:>10.3f}{spread(ours_ms, fmt='.4f'):>24}{spread(base_ms, fmt='.3f'):>22}"
            f"{spread(paired.ratios, fmt='.0f') + 'x':>22}"
        )
    print("target: kvctl under 5 ms per computation at 1,000,000 pages")
    print(load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main())
