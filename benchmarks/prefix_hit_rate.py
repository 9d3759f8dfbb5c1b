"""Prefix-cache hit rate, token-level radix tree vs page-granular hashing, on seeded chat traces.

The workload: a few shared system prompts and many multi-turn conversations, all token ids drawn
from a seed. Up to `--active` conversations are open at once; each request is the next turn of a
random open one: its system prompt, the whole history (user and assistant turns) and a new user
message. A request finishes before the next arrives, and its computed tokens (prompt and all but
the last answer token) are offered to the cache, as the engine does.

Both sides replay the same trace with the same rule that the last prompt token is always
computed:
- token level: kvctl's `PrefixCache` over a `PagePool`: the longest cached prefix at token
  granularity, a partly matched last page included (it is copied on write);
- page granular: vLLM's scheme, ported: a hash chained over each whole page (hash of the parent
  page's hash and the page's tokens), matching whole pages only, at most `(n - 1) // page_size`.

The pool is large enough that nothing is evicted (so the comparison is about granularity alone),
unless `--pool-pages` bounds both sides to the same number of pages (LRU on both).

Figures: hit rate = tokens served from the cache / prompt tokens; prefill saved = prompt tokens
the page-granular side computes / those the token-level side computes; match + insert throughput =
(prompt tokens looked up + computed tokens inserted) / seconds spent in the cache's match, record
and insert; cached-prefix match throughput = tokens matched / seconds when every prompt of the
trace is looked up again in the warm cache (the page-granular side's figure is given beside it).

    python benchmarks/prefix_hit_rate.py [--seeds 0 1 2] [--page-sizes 8 16 32]
        [--conversations 120] [--pool-pages 0]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from kvctl.agent.pool import PagePool
from kvctl.agent.prefix import PrefixCache

VOCAB = 32000
TARGET_MATCH_TOKENS_PER_S = 5_000_000


@dataclass(frozen=True)
class ChatRequest:
    prompt: list[int]
    answer: list[int]


def chat_trace(seed: int, conversations: int, active: int) -> list[ChatRequest]:
    """Seeded multi-turn chat: 4 system prompts (200–1,200 tokens), 2–8 turns per conversation,
    user messages of 8–160 tokens, answers of 16–300 tokens."""
    rng = random.Random(seed)

    def tokens(low: int, high: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(rng.randint(low, high))]

    systems = [tokens(200, 1200) for _ in range(4)]

    def conversation() -> Iterator[ChatRequest]:
        history = list(rng.choice(systems))
        for _ in range(rng.randint(2, 8)):
            history += tokens(8, 160)
            answer = tokens(16, 300)
            yield ChatRequest(list(history), answer)
            history += answer

    trace: list[ChatRequest] = []
    started = 0
    open_ones: list[Iterator[ChatRequest]] = []
    while started < conversations or open_ones:
        while started < conversations and len(open_ones) < active:
            open_ones.append(conversation())
            started += 1
        chosen = rng.randrange(len(open_ones))
        request = next(open_ones[chosen], None)
        if request is None:
            open_ones.pop(chosen)
        else:
            trace.append(request)
    return trace


@dataclass
class SideResult:
    queried: int = 0
    hits: int = 0
    cache_seconds: float = 0.0
    cache_tokens: int = 0  # looked up + inserted
    rematch_tokens: int = 0
    rematch_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queried

    @property
    def throughput(self) -> float:
        return self.cache_tokens / self.cache_seconds

    @property
    def rematch_throughput(self) -> float:
        return self.rematch_tokens / self.rematch_seconds


def token_level(trace: list[ChatRequest], page_size: int, pool_pages: int) -> SideResult:
    """kvctl's path: match, adopt (or allocate), record; grow by the answer; insert; free."""
    pool = PagePool(pool_pages, page_size)
    cache = PrefixCache(pool, "lru", model="bench")
    key = cache.key_for()
    result = SideResult()
    clock = time.perf_counter
    for i, request in enumerate(trace):
        prompt = request.prompt
        started = clock()
        match = cache.match(key, prompt)
        cache.record(match, len(prompt))
        result.cache_seconds += clock() - started
        if match.tokens:
            pool.adopt(i, match.pages, match.tokens, len(prompt))
        else:
            pool.allocate(i, len(prompt))
        pool.append(i, len(request.answer) - 1)
        computed = prompt + request.answer[:-1]
        started = clock()
        cache.insert(key, computed, pool.table(i).pages)
        result.cache_seconds += clock() - started
        pool.free(i)
        result.queried += len(prompt)
        result.hits += match.tokens
        result.cache_tokens += len(prompt) + len(computed)
    for request in trace:
        started = clock()
        match = cache.match(key, request.prompt)
        result.rematch_seconds += clock() - started
        result.rematch_tokens += match.tokens
    cache.check()
    return result


class PageHashCache:
    """vLLM's prefix caching, reduced to what the trace needs.

    Whole pages are identified by a hash chained from the first page. A request's hit pages are
    taken out of the free queue while it runs; its new pages come from free pages first, then by
    evicting the cached page at the head of the queue (least recently freed). When it finishes,
    its whole pages are appended to the queue tail in reverse order (a request's last page is
    evicted before its first) and its partial last page is freed uncached.
    """

    def __init__(self, page_size: int, capacity: int | None) -> None:
        self.page_size = page_size
        self.capacity = capacity
        self.free_uncached = capacity or 0
        self.queue: OrderedDict[int, None] = OrderedDict()  # cached, free: evicted from the head

    def page_hashes(self, tokens: list[int]) -> list[int]:
        size = self.page_size
        hashes: list[int] = []
        parent: int | None = None
        for i in range(len(tokens) // size):
            parent = hash((parent, tuple(tokens[i * size : (i + 1) * size])))
            hashes.append(parent)
        return hashes

    def match(self, prompt: list[int], hashes: list[int]) -> int:
        """Whole pages of `prompt` found, at most `(len(prompt) - 1) // page_size`."""
        limit = (len(prompt) - 1) // self.page_size
        hit = 0
        while hit < limit and hashes[hit] in self.queue:
            hit += 1
        return hit

    def run(self, prompt: list[int], computed: list[int]) -> int:
        """Serve one request that computes `computed` (prompt first); return tokens hit."""
        hashes = self.page_hashes(computed)
        hit = self.match(prompt, hashes)
        for h in hashes[:hit]:
            del self.queue[h]  # in use: not evictable while the request runs
        if self.capacity is not None:
            new = -(-len(computed) // self.page_size) - hit
            taken = min(new, self.free_uncached)
            self.free_uncached -= taken
            for _ in range(new - taken):
                self.queue.popitem(last=False)
        for h in reversed(hashes):
            if h in self.queue:  # computed twice: one copy stays cached, this page is freed
                self.free_uncached += 1
            self.queue[h] = None
        if len(computed) % self.page_size:
            self.free_uncached += 1
        return hit * self.page_size


def page_granular(trace: list[ChatRequest], page_size: int, pool_pages: int | None) -> SideResult:
    cache = PageHashCache(page_size, pool_pages)
    result = SideResult()
    clock = time.perf_counter
    for request in trace:
        prompt = request.prompt
        computed = prompt + request.answer[:-1]
        started = clock()
        hits = cache.run(prompt, computed)
        result.cache_seconds += clock() - started
        result.queried += len(prompt)
        result.hits += hits
        result.cache_tokens += len(prompt) + len(computed)
    for request in trace:
        started = clock()
        hashes = cache.page_hashes(request.prompt)
        result.rematch_tokens += cache.match(request.prompt, hashes) * page_size
        result.rematch_seconds += clock() - started
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--conversations", type=int, default=120)
    parser.add_argument("--active", type=int, default=16, help="conversations open at once")
    parser.add_argument("--pool-pages", type=int, default=0, help="0: large enough for all")
    args = parser.parse_args(argv)
    print("command: python benchmarks/prefix_hit_rate.py " + " ".join(sys.argv[1:]))
    header = (
        f"{'seed':>4} {'page':>4} {'requests':>8} {'prompt tok':>10} {'token-level':>11} "
        f"{'page-gran.':>10} {'ratio':>6} {'prefill saved':>13} {'match+ins M tok/s':>17} "
        f"{'cached match M tok/s':>20} {'page-gran. match':>16}"
    )
    print(header)
    token_wins, fastest_cached = True, float("inf")
    for seed in args.seeds:
        trace = chat_trace(seed, args.conversations, args.active)
        computed = sum(len(r.prompt) + len(r.answer) for r in trace)
        largest = max(len(r.prompt) + len(r.answer) for r in trace)
        for page_size in args.page_sizes:
            pages = args.pool_pages or -(-computed // page_size) + 1
            if pages < -(-largest // page_size):
                print(
                    f"{seed:>4} {page_size:>4} skipped: one request needs more than {pages} pages"
                )
                continue
            ours = token_level(trace, page_size, pages)
            theirs = page_granular(trace, page_size, args.pool_pages or None)
            token_wins &= ours.hits >= theirs.hits
            fastest_cached = min(fastest_cached, ours.rematch_throughput)
            print(
                f"{seed:>4} {page_size:>4} {len(trace):>8} {ours.queried:>10,} "
                f"{ours.hit_rate:>11.2%} {theirs.hit_rate:>10.2%} "
                f"{ours.hit_rate / theirs.hit_rate:>5.3f}x "
                f"{(theirs.queried - theirs.hits) / (ours.queried - ours.hits):>12.3f}x "
                f"{ours.throughput / 1e6:>17.1f} "
                f"{ours.rematch_throughput / 1e6:>20.1f} {theirs.rematch_throughput / 1e6:>16.1f}"
            )
    print(f"token-level hit rate >= page-granular on every trace: {'yes' if token_wins else 'NO'}")
    met = fastest_cached >= TARGET_MATCH_TOKENS_PER_S
    print(
        f"slowest cached-prefix match: {fastest_cached / 1e6:.1f} M tokens/s "
        f"(target {TARGET_MATCH_TOKENS_PER_S / 1e6:.0f} M): {'met' if met else 'NOT met'}"
    )
    return 0 if token_wins and met else 1


if __name__ == "__main__":
    raise SystemExit(main())
