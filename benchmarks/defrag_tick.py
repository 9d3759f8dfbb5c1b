"""Host time of one defragmentation tick (plan + switch page tables), by pool size.

A tick is what the agent's auto-defragmenter runs between two decode steps: at most 64 pages
moved. Its cost must follow the pages moved, not the pool size or the number of live sequences,
or a large node pays for defragmentation on every step. The pool bookkeeping is timed alone (no
tensor copy: `defrag_bandwidth.py` measures the copy against the device's own bandwidth).

The pool is filled the way serving fills it: sequences with prompts of 1-64 pages (log-uniform),
grown page by page, interleaved, until 95 % of the pool is used; then 30 % of them are freed at
random, which leaves the free space in holes all over the pool. Then ticks run one after
another, each on the pool the previous one left; the figures are the median, 90th percentile and
worst tick over the run.

    python benchmarks/defrag_tick.py [--pages 10000,100000,1000000] [--ticks 200]
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time

from paired import command_line, environment

from kvctl.agent.pool import Defragmenter, DefragTrigger, PagePool

PAGE_SIZE = 16
TICK_PAGES = 64


def fragmented_pool(pages: int, seed: int) -> PagePool:
    """A pool with many sequences, 30 % of them then freed at random: the free space in holes."""
    rng = random.Random(seed)
    pool = PagePool(pages, PAGE_SIZE, segment_pages=min(pages, 2048))
    next_id = 0
    live: list[int] = []
    while True:
        prompt = int(math.exp(rng.uniform(0, math.log(64))))
        if pool.free_pages - prompt < pages * 0.05:
            break
        pool.allocate(next_id, prompt * PAGE_SIZE)
        live.append(next_id)
        next_id += 1
        for seq in rng.sample(live, k=min(len(live), 4)):  # decode growth, interleaved
            pool.append(seq, PAGE_SIZE)
    for seq in rng.sample(live, k=int(len(live) * 0.3)):
        pool.free(seq)
    pool.stats()  # as the agent's snapshot would, between steps
    return pool


def tick_times(pool: PagePool, ticks: int) -> list[float]:
    defrag = Defragmenter(pool, copier=None, batch_pages=TICK_PAGES)
    times = []
    gc.collect()
    gc.freeze()
    try:
        for _ in range(ticks):
            start = time.perf_counter()
            report = defrag.run(DefragTrigger.THRESHOLD, max_pages=TICK_PAGES)
            times.append(time.perf_counter() - start)
            if report.pages_moved == 0:
                break
    finally:
        gc.unfreeze()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="10000,100000,1000000")
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(command_line())
    print(environment())
    print(
        f"\n{'pages':>9} {'sequences':>9} {'free runs':>9} {'ticks':>5} "
        f"{'median ms':>9} {'p90 ms':>7} {'max ms':>7} {'us/page':>7}  target < 0.2 ms"
    )
    for pages in (int(p) for p in args.pages.split(",")):
        pool = fragmented_pool(pages, args.seed)
        stats = pool.stats()
        times = sorted(tick_times(pool, args.ticks))
        median = statistics.median(times)
        p90 = times[int(len(times) * 0.9)]
        pool.invariants.check() if pages <= 100_000 else None
        print(
            f"{pages:>9} {stats.sequences:>9} {stats.free_extents:>9} {len(times):>5} "
            f"{median * 1e3:>9.3f} {p90 * 1e3:>7.3f} {times[-1] * 1e3:>7.3f} "
            f"{median / TICK_PAGES * 1e6:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
