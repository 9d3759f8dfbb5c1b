"""Allocation + free throughput of the page pool vs vLLM's free-queue design, on three traces.

Traces (seeded, generated once and replayed identically by both sides):

- `uniform`: 200,000 operations on 100,000 pages, each either allocating 16 pages for a new
  request or freeing a random live one (at most 2,000 live). The easy case: every request has
  the same size.
- `realistic`: what a serving engine does to its pool, on 100,000 pages. Requests arrive with
  prompts of 1-512 pages (log-uniform) and will generate 1-128 pages (log-uniform). They are
  admitted while the pool keeps a headroom of 2 % free; every live sequence then grows one page
  per tick (one page is 16 decode steps); a sequence that reaches its output length is freed;
  every 25 ticks a burst frees 30 % of the live sequences at random (clients that disconnect);
  when growth finds no free page, the youngest sequence is preempted (freed, and re-queued with
  its prompt plus what it had generated, as vLLM's recompute preemption does).
- `pressure`: the same on 10,000 pages, where the pool is full most of the time and
  preemption is frequent.

The trace is decided by page counts alone, which are the same for both sides, so both replay
exactly the same operations. The figure is pages allocated plus pages freed per second. Our side
also reads the pool's statistics every 0.1 s and once at the end, as the agent does: a read
files the pages the allocator handed back loose into the free runs, deferred work that belongs
in the figure.

The baseline is vLLM's block pool design, ported line for line to the operations the traces
need: a hand-made doubly linked list of block objects with batch pop from the head and batch
append at the tail, a reference count per block, and blocks freed in reverse order (as vLLM's
`free` does, so a request's tail is reused first). It has no notion of contiguity; ours hands
out contiguous runs and keeps the free extents that the fragmentation statistics need.

    python benchmarks/pool_alloc_free.py [--trace all|uniform|realistic|pressure]
        [--rounds 7] [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import time
from dataclasses import dataclass

from paired import MIN_ROUNDS, command_line, environment, paired_rounds, spread

from kvctl.agent.pool import PagePool

PAGE_SIZE = 16
STATS_INTERVAL_S = 0.1  # how often the agent reads the pool's statistics (its snapshots)
ALLOC, GROW, FREE = 0, 1, 2


@dataclass
class KVCacheBlock:
    """A page object as vLLM's block pool keeps it: id, reference count, hash, free-list links."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False


class FreeBlockQueue:
    """Doubly linked free list with sentinel head and tail, batch pop and batch append."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for i in range(len(blocks)):
            if i > 0:
                blocks[i].prev_free_block = blocks[i - 1]
            if i < len(blocks) - 1:
                blocks[i].next_free_block = blocks[i + 1]
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free_block = blocks[0]
        blocks[0].prev_free_block = self.head
        self.tail.prev_free_block = blocks[-1]
        blocks[-1].next_free_block = self.tail

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        self.num_free_blocks -= n
        curr = self.head.next_free_block
        ret = []
        for _ in range(n):
            assert curr is not None
            ret.append(curr)
            last = curr
            curr = curr.next_free_block
            last.prev_free_block = None
            last.next_free_block = None
        if curr is not None:
            self.head.next_free_block = curr
            curr.prev_free_block = self.head
        return ret

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        if not blocks:
            return
        last = self.tail.prev_free_block
        assert last is not None
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.tail
        self.tail.prev_free_block = last
        self.num_free_blocks += len(blocks)


class LinkedBlockPool:
    """The allocate/free pair of vLLM's block pool, prefix caching off (its fastest mode)."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            assert block.ref_cnt == 0
            block.ref_cnt += 1
        return ret

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        for block in ordered_blocks:
            block.ref_cnt -= 1
        self.free_block_queue.append_n(
            [block for block in ordered_blocks if block.ref_cnt == 0 and not block.is_null]
        )


Op = tuple[int, int, int]  # (ALLOC, seq, pages) | (GROW, seq, 1) | (FREE, seq, pages)


def uniform_trace(ops: int, max_live: int, per_request: int, seed: int) -> list[Op]:
    """Allocate `per_request` pages for a new request or free a random live one, 50/50."""
    rng = random.Random(seed)
    trace: list[Op] = []
    live: list[int] = []
    next_id = 0
    for _ in range(ops):
        if not live or (len(live) < max_live and rng.random() < 0.5):
            trace.append((ALLOC, next_id, per_request))
            live.append(next_id)
            next_id += 1
        else:
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            trace.append((FREE, live.pop(), per_request))
    return trace


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))


def serving_trace(pages: int, ops: int, seed: int, headroom: float = 0.02) -> list[Op]:
    """The `realistic` and `pressure` traces (see the module docstring), about `ops` long."""
    rng = random.Random(seed)
    trace: list[Op] = []
    free = pages
    reserve = int(pages * headroom)
    # live sequences in admission order: seq -> [pages held, output pages still to generate]
    live: dict[int, list[int]] = {}
    queue: list[tuple[int, int]] = []  # (prompt pages, output pages), head first
    next_id = 0
    tick = 0

    def release(seq: int) -> None:
        nonlocal free
        held = live.pop(seq)[0]
        free += held
        trace.append((FREE, seq, held))

    while len(trace) < ops:
        tick += 1
        while len(queue) < 64:
            queue.append((_log_uniform(rng, 1, 512), _log_uniform(rng, 1, 128)))
        while queue and queue[0][0] <= free - reserve:
            prompt, output = queue.pop(0)
            live[next_id] = [prompt, output]
            free -= prompt
            trace.append((ALLOC, next_id, prompt))
            next_id += 1
        for seq in list(live):
            state = live.get(seq)
            if state is None:  # preempted earlier in this tick
                continue
            if not free:
                youngest = next(reversed(live))
                held, remaining = live[youngest]
                release(youngest)
                queue.insert(0, (held, remaining))
                if youngest == seq:
                    continue
            state[0] += 1
            state[1] -= 1
            free -= 1
            trace.append((GROW, seq, 1))
            if state[1] <= 0:
                release(seq)
        if tick % 25 == 0 and live:
            for seq in rng.sample(list(live), k=int(len(live) * 0.3)):
                release(seq)
    return trace


def replay_linked(pool: LinkedBlockPool, trace: list[Op]) -> int:
    tables: dict[int, list[KVCacheBlock]] = {}
    moved = 0
    for kind, seq, n in trace:
        if kind == GROW:
            tables[seq].extend(pool.get_new_blocks(1))
        elif kind == ALLOC:
            tables[seq] = pool.get_new_blocks(n)
        else:
            pool.free_blocks(list(reversed(tables.pop(seq))))
        moved += n
    return moved


def replay_pool(pool: PagePool, trace: list[Op], stats_interval: float = STATS_INTERVAL_S) -> int:
    """Replay on our pool, reading its statistics every `stats_interval` seconds as the agent
    does (its snapshots): a read files the loose pages into the free runs, which is work the
    allocator deferred, so it is timed too."""
    append, allocate, free = pool.append, pool.allocate, pool.free
    clock = time.perf_counter
    next_read = clock() + stats_interval
    moved = 0
    for kind, seq, n in trace:
        if kind == GROW:
            append(seq, PAGE_SIZE)
        elif kind == ALLOC:
            allocate(seq, n * PAGE_SIZE)
            if clock() >= next_read:  # looked at on allocations only: one op in about 20
                pool.stats()
                next_read = clock() + stats_interval
        else:
            free(seq)
        moved += n
    pool.stats()
    return moved


def timed(replay, pool, trace: list[Op]) -> float:
    """Pages per second of one replay on a freshly built pool. Building is not timed, and what
    it built is frozen out of the cyclic GC (as long-running servers do with `gc.freeze()`); the
    GC stays on during the replay, for both sides alike."""
    gc.collect()
    gc.freeze()
    try:
        start = time.perf_counter()
        pages = replay(pool, trace)
        return pages / (time.perf_counter() - start)
    finally:
        gc.unfreeze()


def build_trace(name: str, args: argparse.Namespace) -> tuple[int, list[Op]]:
    if name == "uniform":
        return 100_000, uniform_trace(200_000, 2_000, 16, args.seed)
    if name == "realistic":
        return 100_000, serving_trace(100_000, args.ops, args.seed)
    return 10_000, serving_trace(10_000, args.ops, args.seed)


def describe(trace: list[Op]) -> str:
    counts = [0, 0, 0]
    pages = [0, 0, 0]
    for kind, _, n in trace:
        counts[kind] += 1
        pages[kind] += n
    return (
        f"{counts[ALLOC]} allocations ({pages[ALLOC]} pages), {counts[GROW]} one-page growths, "
        f"{counts[FREE]} frees ({pages[FREE]} pages)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trace", choices=["all", "uniform", "realistic", "pressure"], default="all"
    )
    parser.add_argument("--ops", type=int, default=400_000, help="operations per serving trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: fewer pairs say little")
    print(command_line())
    print(environment())
    names = ["uniform", "realistic", "pressure"] if args.trace == "all" else [args.trace]
    for name in names:
        pages, trace = build_trace(name, args)
        paired = paired_rounds(
            lambda pages=pages, trace=trace: timed(replay_pool, PagePool(pages, PAGE_SIZE), trace),
            lambda pages=pages, trace=trace: timed(replay_linked, LinkedBlockPool(pages), trace),
            args.rounds,
        )
        print(f"\n{name}: {pages} pages; {describe(trace)}")
        print(f"  vLLM free queue (baseline): {spread(paired.base, 1e-6)} M pages/s")
        print(f"  kvctl PagePool:             {spread(paired.ours, 1e-6)} M pages/s")
        print(f"  ratio ours/baseline:        {paired.ratio_summary()}; target 2x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
