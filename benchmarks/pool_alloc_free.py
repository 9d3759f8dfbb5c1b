"""Allocation + free throughput of the page pool vs a linked-list free queue, on one trace.

The trace: a 100,000-page pool and 200,000 operations, each either allocating 16 pages for a new
request or freeing a random live request (at most 2,000 live), from a seed. Both sides replay the
same trace and the figure is pages allocated plus pages freed per second.

The baseline is vLLM's block pool design, ported line for line to the operations this trace
needs: a hand-made doubly linked list of block objects with batch pop from the head and batch
append at the tail, plus a reference count per block. It is fast, but it has no notion of
contiguity; ours hands out contiguous runs when it can and keeps the free extents that the
fragmentation statistics need (short freed runs are coalesced lazily, as malloc's fast bins do;
every statistic reads them coalesced).

    python benchmarks/pool_alloc_free.py [--pages 100000] [--ops 200000] [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass

from kvctl.agent.pool import PagePool

PAGE_SIZE = 16


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


def make_trace(ops: int, max_live: int, seed: int) -> list[int]:
    """Per operation: -1 allocate, else the index into the live list of the request to free."""
    rng = random.Random(seed)
    trace = []
    live = 0
    for _ in range(ops):
        if live == 0 or (live < max_live and rng.random() < 0.5):
            trace.append(-1)
            live += 1
        else:
            trace.append(rng.randrange(live))
            live -= 1
    return trace


def replay_linked(pool: LinkedBlockPool, trace: list[int], per_request: int) -> int:
    live: list[list[KVCacheBlock]] = []
    moved = 0
    for op in trace:
        if op < 0:
            live.append(pool.get_new_blocks(per_request))
        else:
            victim = live[op]
            live[op] = live[-1]
            live.pop()
            pool.free_blocks(victim)
        moved += per_request
    return moved


def replay_pool(pool: PagePool, trace: list[int], per_request: int) -> int:
    tokens = per_request * PAGE_SIZE
    live: list[int] = []
    moved = 0
    next_id = 0
    for op in trace:
        if op < 0:
            pool.allocate(next_id, tokens)
            live.append(next_id)
            next_id += 1
        else:
            victim = live[op]
            live[op] = live[-1]
            live.pop()
            pool.free(victim)
        moved += per_request
    return moved


def timed(replay, pool, trace: list[int], per_request: int) -> tuple[float, int]:
    """Wall time of one replay on a freshly built pool. Building is not timed, and what it
    built is frozen out of the cyclic GC (as long-running servers do with `gc.freeze()`); the GC
    stays on during the replay, for both sides alike."""
    gc.collect()
    gc.freeze()
    try:
        start = time.perf_counter()
        pages = replay(pool, trace, per_request)
        return time.perf_counter() - start, pages
    finally:
        gc.unfreeze()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=100_000)
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--pages-per-request", type=int, default=16)
    parser.add_argument("--max-live", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=11)
    args = parser.parse_args(argv)
    print("command: python benchmarks/pool_alloc_free.py " + " ".join(sys.argv[1:]))
    trace = make_trace(args.ops, args.max_live, args.seed)
    ours, base, ratios = [], [], []
    for _ in range(args.repeat):  # paired rounds: the machine drifts between them
        linked = LinkedBlockPool(args.pages)
        seconds, pages = timed(replay_linked, linked, trace, args.pages_per_request)
        base.append(pages / seconds)
        del linked
        pool = PagePool(args.pages, PAGE_SIZE)
        seconds, pages = timed(replay_pool, pool, trace, args.pages_per_request)
        ours.append(pages / seconds)
        ratios.append(ours[-1] / base[-1])
    ratios.sort()
    print(f"trace: {args.ops} ops on {args.pages} pages, {args.pages_per_request} pages/request")
    print(f"linked free list (baseline): {statistics.median(base) / 1e6:6.2f} M pages/s (median)")
    print(f"kvctl PagePool:              {statistics.median(ours) / 1e6:6.2f} M pages/s (median)")
    print(
        f"ratio ours/baseline:         {statistics.median(ratios):6.2f}x (median of "
        f"{args.repeat} paired rounds, {ratios[0]:.2f}x to {ratios[-1]:.2f}x; target 2x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
