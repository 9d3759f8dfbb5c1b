"""Prefix-cache eviction and match+insert speed: kvctl's `PrefixCache` vs SGLang's radix cache.

Traces (seeded; generated once per run and replayed identically by both sides, one request at
a time: match the prompt but its last token, take pages for the rest, insert every computed
token, free):

- `shared`: the multi-turn chat trace of `prefix_hit_rate.py` (4 system prompts of 200–1,200
  tokens, 2–8 turns per conversation, up to 16 open at once), on a pool large enough that
  nothing is evicted. Figure: match + insert throughput = (prompt tokens looked up + computed
  tokens inserted) / seconds spent in the cache's lookup and insert.
- `unique`: independent prompts of 200–2,000 tokens with answers of 16–300 tokens, nothing in
  common between requests (the first tokens differ too). Same figure.
- `evict`: a longer chat trace (64 conversations open at once) on a pool that holds only a
  fraction of what it computes, so most allocations evict. Figure: tokens evicted / seconds
  spent in the cache's eviction.

Each is run at page size 1 and 16, in paired, interleaved rounds (`paired.py`); the ratio is
ours / baseline per round, >= 1 meaning kvctl is at least as fast.

What is timed, on each side: kvctl: `PrefixCache.match`, `record` and `insert` (which takes the
cache's hold on the new pages in the pool: `pool.holds.hold`), and `evict` as the pool calls
it when short (which gives the pages back: `pool.holds.release`); the pool's own reference
counting (`adopt`, `free`) is not timed. Baseline: `match_prefix` of the prompt but its last
token (the slice SGLang's scheduler takes) and `insert` of the page-aligned tokens
(`page_align_keys`), and `evict`, with the allocator `free` it calls; its lock references and
allocations are not timed. Three more kvctl replays, not paired, time the pool's two calls apart
(at page size 1 they are one Python step per page, where SGLang's tree needs none) and give
kvctl's figure without them (from the fastest of the three).

The baseline is a port of SGLang's `RadixCache` (python/sglang/srt/mem_cache/radix_cache.py),
kept to the operations the traces need; see `SGLangRadixCache`. Both sides evict least recently
used first, and both are asked for the same number of tokens: what the allocation lacks
(SGLang's scheduler asks for the whole allocation instead; asking both for the shortfall keeps
the work the same). SGLang evicts whole leaves where kvctl evicts pages from a leaf's tail, so
the tokens evicted differ slightly; the figure is per token evicted.

    python benchmarks/prefix_evict.py [--seed 0] [--rounds 7] [--page-sizes 1 16]
        [--traces shared unique evict]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import chain

from paired import MIN_ROUNDS, command_line, environment, paired_rounds, spread
from prefix_hit_rate import VOCAB, ChatRequest, chat_trace

from kvctl.agent.pool import PagePool
from kvctl.agent.prefix import PrefixCache

# ---- the baseline: SGLang's radix cache ---------------------------------------------------------


class TreeNode:
    """SGLang's `TreeNode`, with the attributes the ported operations read (hashes, host values
    and priorities are left out)."""

    counter = 0

    def __init__(self) -> None:
        self.children: dict = {}
        self.parent: TreeNode | None = None
        self.key: list[int] = []
        self.value: list[int] | None = None
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.id = TreeNode.counter
        TreeNode.counter += 1

    @property
    def evicted(self) -> bool:
        return self.value is None

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time


def _key_match_page_size1(key0: list[int], key1: list[int]) -> int:
    i = 0
    for k0, k1 in zip(key0, key1, strict=False):
        if k0 != k1:
            break
        i += 1
    return i


def _key_match_paged(key0: list[int], key1: list[int], page_size: int) -> int:
    min_len = min(len(key0), len(key1))
    i = 0
    while i < min_len:
        if key0[i : i + page_size] != key1[i : i + page_size]:
            break
        i += page_size
    return i


def get_child_key(key: list[int], page_size: int = 1) -> int | tuple[int, ...]:
    if page_size == 1:
        return key[0]
    return tuple(key[:page_size])


class SlotAllocator:
    """SGLang's token-to-KV allocators reduced to a free list: token slots at page size 1, pages
    above it (a page `p` holds the slots `p * page_size ...`); slot 0 is reserved, as there."""

    def __init__(self, tokens: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_pages = list(range(1, tokens // page_size + 1))

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, need_size: int) -> list[int] | None:
        size = self.page_size
        pages = -(-need_size // size)
        if pages > len(self.free_pages):
            return None
        taken = self.free_pages[:pages]
        del self.free_pages[:pages]
        if size == 1:
            return taken
        return [p * size + i for p in taken for i in range(size)][:need_size]

    def free(self, free_index: list[int]) -> None:
        if not free_index:
            return
        if self.page_size == 1:
            self.free_pages.extend(free_index)
        else:
            size = self.page_size
            self.free_pages.extend(sorted({i // size for i in free_index}))


class SGLangRadixCache:
    """SGLang's `RadixCache`, ported to the operations the traces need.

    Kept as SGLang has them: nodes keyed in their parent by their first token (page size 1) or
    the tuple of their first page's tokens; `match_prefix` walks with `_key_match_page_size1` or
    the paged match, refreshing `last_access_time` and splitting the node a match ends inside;
    `insert` does the same and adds a leaf; lock references and the set of evictable leaves are
    maintained on every change; `evict(num_tokens)` heapifies the evictable leaves by last access
    time, pops, frees the leaf's slots, deletes it and pushes its parent when that becomes an
    evictable leaf.

    Changed: keys and values are plain Python lists of ints instead of `RadixKey` objects and
    torch tensors (no extra key, so no `extra_key` checks), `torch.cat` of the matched values is
    a list concatenation, `clone()` a list copy; no events, metrics or host cache.
    """

    def __init__(self, page_size: int, allocator: SlotAllocator) -> None:
        self.page_size = page_size
        self.token_to_kv_pool_allocator = allocator
        if page_size == 1:
            self.key_match_fn: Callable[[list[int], list[int]], int] = _key_match_page_size1
            self.get_child_key_fn: Callable[[list[int]], object] = get_child_key
        else:
            self.key_match_fn = partial(_key_match_paged, page_size=page_size)
            self.get_child_key_fn = partial(get_child_key, page_size=page_size)
        self.evictable_leaves: set[TreeNode] = set()
        self.reset()

    def reset(self) -> None:
        self.root_node = TreeNode()
        self.root_node.key = []
        self.root_node.value = []
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves.clear()

    def match_prefix(self, key: list[int]) -> tuple[list[int], TreeNode]:
        if len(key) == 0:
            return [], self.root_node
        if self.page_size != 1:
            page_aligned_len = len(key) // self.page_size * self.page_size
            key = key[:page_aligned_len]
        if len(key) == 0:
            return [], self.root_node
        value, last_node = self._match_prefix_helper(self.root_node, key)
        return list(chain.from_iterable(value)), last_node

    def insert(self, key: list[int], value: list[int]) -> int:
        return self._insert_helper(self.root_node, key, value)

    def evict(self, num_tokens: int) -> int:
        leaves = list(self.evictable_leaves)
        eviction_heap = [(node.last_access_time, node) for node in leaves]
        heapq.heapify(eviction_heap)
        num_evicted = 0
        while num_evicted < num_tokens and len(eviction_heap):
            _priority, x = heapq.heappop(eviction_heap)
            self.token_to_kv_pool_allocator.free(x.value)
            num_evicted += len(x.value)
            self._delete_leaf(x)
            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:
                heapq.heappush(eviction_heap, (x.parent.last_access_time, x.parent))
        return num_evicted

    def inc_lock_ref(self, node: TreeNode) -> int:
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent
        return delta

    def evictable_size(self) -> int:
        return self.evictable_size_

    def _match_prefix_helper(self, node: TreeNode, key: list[int]) -> tuple[list, TreeNode]:
        access_time = time.monotonic()
        node.last_access_time = access_time
        child_key = self.get_child_key_fn(key)
        value = []
        while len(key) > 0 and child_key in node.children:
            child = node.children[child_key]
            child.last_access_time = access_time
            prefix_len = self.key_match_fn(child.key, key)
            if prefix_len < len(child.key):
                new_node = self._split_node(child.key, child, prefix_len)
                value.append(new_node.value)
                node = new_node
                break
            value.append(child.value)
            node = child
            key = key[prefix_len:]
            if len(key):
                child_key = self.get_child_key_fn(key)
        return value, node

    def _split_node(self, key: list[int], child: TreeNode, split_len: int) -> TreeNode:
        new_node = TreeNode()
        new_node.children = {self.get_child_key_fn(key[split_len:]): child}
        new_node.parent = child.parent
        new_node.lock_ref = child.lock_ref
        new_node.key = child.key[:split_len]
        new_node.value = child.value[:split_len]
        child.parent = new_node
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        new_node.parent.children[self.get_child_key_fn(key)] = new_node
        return new_node

    def _insert_helper(self, node: TreeNode, key: list[int], value: list[int]) -> int:
        access_time = time.monotonic()
        node.last_access_time = access_time
        if len(key) == 0:
            return 0
        child_key = self.get_child_key_fn(key)
        total_prefix_length = 0
        while len(key) > 0 and child_key in node.children:
            node = node.children[child_key]
            node.last_access_time = access_time
            prefix_len = self.key_match_fn(node.key, key)
            total_prefix_length += prefix_len
            key = key[prefix_len:]
            value = value[prefix_len:]
            if prefix_len < len(node.key):
                new_node = self._split_node(node.key, node, prefix_len)
                node = new_node
            if len(key):
                child_key = self.get_child_key_fn(key)
        if len(key):
            new_node = TreeNode()
            new_node.parent = node
            new_node.key = key
            new_node.value = list(value)
            node.children[child_key] = new_node
            self.evictable_size_ += len(key)
            self._update_leaf_status(node)
            self._update_leaf_status(new_node)
        return total_prefix_length

    def _delete_leaf(self, node: TreeNode) -> None:
        assert node.parent is not None
        key = self.get_child_key_fn(node.key)
        v = node.parent.children.pop(key, None)
        assert v == node, f"parent does not have child key, {key}"
        self.evictable_size_ -= len(node.key)
        if node in self.evictable_leaves:
            self.evictable_leaves.remove(node)
        self._update_leaf_status(node.parent)

    def _update_leaf_status(self, node: TreeNode) -> None:
        if node.evicted or node.lock_ref > 0:
            if node in self.evictable_leaves:
                self.evictable_leaves.remove(node)
            return
        for child in node.children.values():
            if not child.evicted:
                if node in self.evictable_leaves:
                    self.evictable_leaves.remove(node)
                return
        if node not in self.evictable_leaves:
            self.evictable_leaves.add(node)


# ---- traces -----------------------------------------------------------------------------------


def unique_trace(seed: int, requests: int) -> list[ChatRequest]:
    """Independent prompts of 200–2,000 tokens and answers of 16–300; every prompt starts with a
    token no other prompt starts with, so nothing is shared, not even a first token."""
    rng = random.Random(seed)
    firsts = rng.sample(range(VOCAB), requests)
    trace = []
    for first in firsts:
        prompt = [first] + [rng.randrange(VOCAB) for _ in range(rng.randint(199, 1999))]
        answer = [rng.randrange(VOCAB) for _ in range(rng.randint(16, 300))]
        trace.append(ChatRequest(prompt, answer))
    return trace


@dataclass(frozen=True)
class Case:
    name: str
    trace: list[ChatRequest]
    page_size: int
    capacity_tokens: int  # both sides get this many KV slots

    @property
    def computed(self) -> int:
        return sum(len(r.prompt) + len(r.answer) - 1 for r in self.trace)


@dataclass
class Replay:
    """What one side did on one trace: tokens looked up and inserted, tokens hit, tokens
    evicted, and the seconds spent in the cache's match + insert and in its eviction."""

    cache_tokens: int = 0
    hits: int = 0
    evicted: int = 0
    cache_seconds: float = 0.0
    evict_seconds: float = 0.0
    hold_seconds: float = 0.0  # kvctl: of `cache_seconds`, in the pool's `holds.hold`
    release_seconds: float = 0.0  # kvctl: of `evict_seconds`, in the pool's `holds.release`


# ---- the two sides ----------------------------------------------------------------------------


def replay_kvctl(case: Case, split_pool: bool = False) -> Replay:
    """kvctl's path, as the engine runs it: match, adopt (evicting through the pool when short),
    record, insert the computed tokens, free. `split_pool` also times the pool's side of the
    cache's work apart (it adds a call per insert and per leaf evicted, so not in paired rounds)."""
    page_size = case.page_size
    pool = PagePool(case.capacity_tokens // page_size, page_size)
    cache = PrefixCache(pool, "lru", model="bench")
    key = cache.key_for()
    out = Replay()
    clock = time.perf_counter
    hold_seconds, release_seconds = [0.0], [0.0]
    if split_pool:
        pool.holds.hold = _timed(pool.holds.hold, hold_seconds)
        pool.holds.release = _timed(pool.holds.release, release_seconds)

    def evictor(num_pages: int, reason: str = "allocation") -> int:
        started = clock()
        freed = cache.evict(num_pages)
        out.evict_seconds += clock() - started
        out.evicted += freed * page_size
        return freed

    pool.set_evictor(evictor)
    match, record, insert = cache.match, cache.record, cache.insert
    gc.collect()
    gc.freeze()
    for i, request in enumerate(case.trace):
        prompt = request.prompt
        computed = prompt + request.answer[:-1]
        started = clock()
        found = match(key, prompt)
        record(found, len(prompt))
        out.cache_seconds += clock() - started
        if found.tokens:
            pool.adopt(i, found.pages, found.tokens, len(computed))
        else:
            pool.allocate(i, len(computed))
        pages = pool.table(i).pages
        started = clock()
        insert(key, computed, pages)
        out.cache_seconds += clock() - started
        pool.free(i)
        out.hits += found.tokens
        out.cache_tokens += len(prompt) + len(computed)
    gc.unfreeze()
    out.hold_seconds, out.release_seconds = hold_seconds[0], release_seconds[0]
    return out


def _timed(method: Callable[[list[int]], None], total: list[float]) -> Callable[[list[int]], None]:
    clock = time.perf_counter

    def timed(pages: list[int]) -> None:
        started = clock()
        method(pages)
        total[0] += clock() - started

    return timed


def replay_sglang(case: Case) -> Replay:
    """SGLang's path: match (page-aligned), lock the matched node, allocate the rest (evicting
    what the allocator lacks), insert the page-aligned computed tokens, free the duplicates and
    the unaligned tail, unlock."""
    page_size = case.page_size
    allocator = SlotAllocator(case.capacity_tokens, page_size)
    cache = SGLangRadixCache(page_size, allocator)
    out = Replay()
    clock = time.perf_counter
    gc.collect()
    gc.freeze()
    for request in case.trace:
        prompt = request.prompt
        computed = prompt + request.answer[:-1]
        started = clock()
        prefix, last_node = cache.match_prefix(prompt[:-1])
        out.cache_seconds += clock() - started
        cache.inc_lock_ref(last_node)
        matched = len(prefix)
        need = len(computed) - matched
        short = -(-need // page_size) * page_size - allocator.available_size()
        if short > 0:
            started = clock()
            out.evicted += cache.evict(short)
            out.evict_seconds += clock() - started
        new = allocator.alloc(need)
        if new is None:
            raise RuntimeError("the baseline ran out of KV slots")
        kv_indices = prefix + new
        aligned = len(computed) // page_size * page_size
        started = clock()
        keys = computed if page_size == 1 else computed[:aligned]  # page_align_keys
        new_prefix_len = cache.insert(keys, kv_indices[:aligned])
        out.cache_seconds += clock() - started
        allocator.free(kv_indices[matched:new_prefix_len])
        allocator.free(kv_indices[aligned:])
        cache.dec_lock_ref(last_node)
        out.hits += matched
        out.cache_tokens += len(prompt) + len(computed)
    gc.unfreeze()
    return out


# ---- running ----------------------------------------------------------------------------------


def build_cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    shared = chat_trace(args.seed, args.conversations, 16)
    unique = unique_trace(args.seed, args.unique_requests)
    evicting = chat_trace(args.seed + 1, args.evict_conversations, 64)
    for trace_name in args.traces:
        for page_size in args.page_sizes:
            if trace_name == "shared":
                trace = shared
            elif trace_name == "unique":
                trace = unique
            else:
                trace = evicting
            computed = sum(len(r.prompt) + len(r.answer) for r in trace)
            if trace_name == "evict":
                largest = max(len(r.prompt) + len(r.answer) for r in trace)
                capacity = max(int(computed * args.evict_fraction), 2 * largest)
            else:
                capacity = computed + page_size
            capacity = -(-capacity // page_size) * page_size + page_size
            cases.append(Case(trace_name, trace, page_size, capacity))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    traces = ["shared", "unique", "evict"]
    parser.add_argument("--traces", nargs="+", choices=traces, default=traces)
    parser.add_argument("--conversations", type=int, default=120)
    parser.add_argument("--unique-requests", type=int, default=400)
    parser.add_argument("--evict-conversations", type=int, default=400)
    parser.add_argument(
        "--evict-fraction", type=float, default=0.1, help="pool size / tokens the trace computes"
    )
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: fewer pairs say little")
    print(command_line())
    print(environment())
    all_met = True
    for case in build_cases(args):
        ours_runs: list[Replay] = []
        base_runs: list[Replay] = []
        evicting = case.name == "evict"

        def figure(run: Replay, evicting: bool = evicting) -> float:
            if evicting:
                return run.evicted / run.evict_seconds
            return run.cache_tokens / run.cache_seconds

        def ours(case: Case = case, runs: list[Replay] = ours_runs) -> float:
            runs.append(replay_kvctl(case))
            return figure(runs[-1])

        def base(case: Case = case, runs: list[Replay] = base_runs) -> float:
            runs.append(replay_sglang(case))
            return figure(runs[-1])

        paired = paired_rounds(ours, base, args.rounds)
        what = "tokens evicted / s in evict" if evicting else "match + insert tokens / s"
        o, b = ours_runs[0], base_runs[0]
        print(
            f"\n{case.name}, page size {case.page_size}: {len(case.trace)} requests, "
            f"{case.computed:,} tokens computed, {case.capacity_tokens:,} KV slots"
        )
        print(
            f"  hits: kvctl {o.hits:,} tokens, SGLang {b.hits:,}; "
            f"evicted: kvctl {o.evicted:,}, SGLang {b.evicted:,}"
        )
        if evicting:
            print(
                f"  time in evict: kvctl {spread([r.evict_seconds for r in ours_runs], 1e3)} ms, "
                f"SGLang {spread([r.evict_seconds for r in base_runs], 1e3)} ms"
            )
        print(f"  SGLang radix cache (baseline): {spread(paired.base, 1e-6)} M {what}")
        print(f"  kvctl PrefixCache:             {spread(paired.ours, 1e-6)} M {what}")
        print(f"  ratio ours/baseline:           {paired.ratio_summary()}; target >= 1x")
        split = min(
            (replay_kvctl(case, split_pool=True) for _ in range(3)),
            key=lambda r: r.evict_seconds if evicting else r.cache_seconds,
        )
        if evicting:
            part, total, name = split.release_seconds, split.evict_seconds, "holds.release"
            work = split.evicted
        else:
            part, total, name = split.hold_seconds, split.cache_seconds, "holds.hold"
            work = split.cache_tokens
        own = work / (total - part)
        print(
            f"  kvctl's time in the pool's {name} (timed apart, best of 3 more): "
            f"{part * 1e3:.1f} of {total * 1e3:.1f} ms"
        )
        print(
            f"  kvctl without it:              {own * 1e-6:.2f} M {what}, "
            f"{own / statistics.median(paired.base):.2f}x the baseline's median"
        )
        all_met &= paired.median_ratio >= 1.0
    print(f"\nevery median ratio >= 1x: {'yes' if all_met else 'NO'}")
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
