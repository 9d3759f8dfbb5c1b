"""Hypothesis: random interleavings of admissions with shared prefixes, decodes, finishes,
evictions, policy changes, defragmentation and resizes keep the pool's and the cache's invariants,
and every token a request or the tree relies on stays in its page.

Page contents are simulated: each page slot holds the token whose K/V it would hold, copies and
moves copy them, and the model's writes fill them. So "tokens intact" means what the model would
read: a request's pages hold its tokens at every position it computed or adopted, and every tree
page holds the tokens of its branch.

The cache keeps its eviction order up to date as the trees change instead of sorting every leaf
per eviction; after every step the order must equal a fresh sort of the evictable leaves, and
every eviction must free exactly what the former from-scratch eviction (`evict_from_scratch`,
run on a copy) frees. Page size 3 has edges that end mid-page; page size 1 has a page per token.
"""

import contextlib
import copy
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvctl.agent.pool import Defragmenter, PagePool, PoolResizer, ResizeRefused
from kvctl.agent.prefix import EVICTION_POLICIES, IsolationKey, PrefixCache, RadixNode, make_policy

SEGMENT = 8
MAX_RUNNING = 6
# a small alphabet and a few shared bases: prompts overlap at every kind of position
BASES = [[1, 1, 2, 0, 1, 2, 2], [1, 1, 2, 0, 2], [2, 0, 0, 1, 1, 1, 1, 2, 0]]
prompts = st.builds(
    lambda base, cut, suffix: base[:cut] + suffix,
    st.sampled_from(BASES),
    st.integers(2, 9),
    st.lists(st.integers(0, 2), min_size=1, max_size=5),
)


class SimulatedStorage:
    """Page contents as token ids, with the real storage's rule that a batch of copies never
    writes a page another copy of the batch reads."""

    def __init__(self, pages: int, page_size: int) -> None:
        self.page = page_size
        self.slots: list[list[int | None]] = [[None] * page_size for _ in range(pages)]

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        assert len(set(dst)) == len(dst) and not set(dst) & set(src), "overlapping copies"
        snapshot = [list(self.slots[s]) for s in src]
        for d, contents in zip(dst, snapshot, strict=True):
            self.slots[d] = contents

    def add_segments(self, count: int) -> None:
        self.slots.extend([None] * self.page for _ in range(count * SEGMENT))

    def release_segments(self, count: int) -> None:
        del self.slots[-count * SEGMENT :]

    def write(self, pages: list[int], start: int, tokens: list[int]) -> None:
        page = self.page
        for position, token in enumerate(tokens, start):
            self.slots[pages[position // page]][position % page] = token

    def read(self, pages: list[int], length: int) -> list[int | None]:
        page = self.page
        return [self.slots[pages[i // page]][i % page] for i in range(length)]


def evictable_leaves(cache: PrefixCache) -> list[tuple[IsolationKey, RadixNode]]:
    """Every leaf whose last page eviction may free, sorted afresh by the policy."""
    priority = make_policy(cache.policy).priority
    refcount = cache.pool.pages.refcount
    leaves = [
        (key, leaf)
        for key in cache.partitions()
        for leaf in cache.tree(key).leaves
        if not refcount(leaf.pages[-1])
    ]
    return sorted(leaves, key=lambda item: priority(item[1]))


def evict_from_scratch(cache: PrefixCache, num_pages: int) -> int:
    """The eviction `PrefixCache.evict` did before it kept an order, applied to `cache` (a copy):
    a heap of every leaf whose last page can go, built for the call; a parent that becomes a leaf
    joins it; each leaf gives up its last pages that no request uses. (Nothing is pinned between
    steps.)"""
    pool = cache.pool
    priority = make_policy(cache.policy).priority
    ties = itertools.count()
    trees = {key: cache.tree(key) for key in cache.partitions()}
    heap = [
        (priority(leaf), next(ties), leaf, key)
        for key, tree in trees.items()
        for leaf in tree.leaves
        if not pool.pages.refcount(leaf.pages[-1])
    ]
    heapq.heapify(heap)
    freed = 0
    while freed < num_pages and heap:
        _, _, leaf, key = heapq.heappop(heap)
        if leaf.parent is None or not leaf.is_leaf:
            continue
        tail = len(
            list(itertools.takewhile(lambda p: not pool.pages.refcount(p), reversed(leaf.pages)))
        )
        count = min(tail, num_pages - freed)
        dropped, remaining = trees[key].drop_last_pages(leaf, count)
        pool.holds.release(dropped)
        freed += count
        if remaining not in (None, leaf) and not pool.pages.refcount(remaining.pages[-1]):
            heapq.heappush(heap, (priority(remaining), next(ties), remaining, key))
    return freed


def trees_of(cache: PrefixCache) -> dict[IsolationKey, str]:
    return {key: cache.render(key) for key in cache.partitions() if cache.render(key)}


@dataclass
class Running:
    key: IsolationKey
    tokens: list[int]


class PrefixReuse(RuleBasedStateMachine):
    page = 3

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(2 * SEGMENT, self.page, SEGMENT)
        self.cache = PrefixCache(self.pool, "lru", model="m")
        self.storage = SimulatedStorage(self.pool.capacity, self.page)
        self.defragmenter = Defragmenter(self.pool, self.storage)
        self.resizer = PoolResizer(
            self.pool, self.defragmenter, self.storage, max_pages=5 * SEGMENT
        )
        self.running: dict[str, Running] = {}
        self.names = (f"r{i}" for i in itertools.count())

    @initialize(
        finished=st.lists(prompts, min_size=1, max_size=4),
        running=st.lists(prompts, min_size=1, max_size=3),
    )
    def warm_up(self, finished: list[list[int]], running: list[list[int]]) -> None:
        """Start with some prefixes cached and requests running on them, so that most runs see
        hits, copies and shared pages from their first step."""
        self.admit(finished, None)
        for name in sorted(self.running):
            self._finish(name)
        self.admit(running, None)

    @rule(batch=st.lists(prompts, min_size=1, max_size=3), salt=st.sampled_from([None, "t"]))
    def admit(self, batch: list[list[int]], salt: str | None) -> None:
        """One prefill step, as the scheduler runs it: adopt or allocate each request that fits,
        pin copy sources, apply the copies, then compute the unmatched tokens."""
        pool, cache = self.pool, self.cache
        key = cache.key_for(salt)
        batch = batch[: MAX_RUNNING - len(self.running)]
        admitted, copies = [], []
        for prompt in batch:
            match = cache.match(key, prompt)
            needed = pool.pages_for(len(prompt)) - match.full_pages
            if needed > pool.free_pages + cache.evictable_pages(match):
                continue
            name = next(self.names)
            if match.tokens:
                _, step_copies = pool.adopt(name, match.pages, match.tokens, len(prompt))
                cache.pin([c.src for c in step_copies])
                copies.extend(step_copies)
            else:
                pool.allocate(name, len(prompt))
            cache.record(match, len(prompt))
            admitted.append((name, prompt, match.tokens))
        self.storage.copy_pages([c.src for c in copies], [c.dst for c in copies])
        cache.unpin_all()
        for name, prompt, matched in admitted:
            pages = self.pool.table(name).pages
            assert self.storage.read(pages, matched) == prompt[:matched], "adopted K/V differ"
            self.storage.write(pages, matched, prompt[matched:])
            self.running[name] = Running(key, list(prompt))

    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        if not self.running:
            return
        name = data.draw(st.sampled_from(sorted(self.running)))
        if not self.pool.can_append(name, 1):
            return
        copies = self.pool.append(name, 1)
        self.storage.copy_pages([c.src for c in copies], [c.dst for c in copies])
        request = self.running[name]
        self.storage.write(self.pool.table(name).pages, len(request.tokens), [token])
        request.tokens.append(token)

    @rule(data=st.data())
    def finish_or_preempt(self, data: st.DataObject) -> None:
        """Both give the computed whole pages to the cache, then free the sequence."""
        if self.running:
            self._finish(data.draw(st.sampled_from(sorted(self.running))))

    def _finish(self, name: str) -> None:
        request = self.running.pop(name)
        new = self.cache.insert(request.key, request.tokens, self.pool.table(name).pages)
        assert 0 <= new <= len(request.tokens) // self.page
        self.pool.free(name)

    @rule(
        pages=st.one_of(st.integers(1, 3), st.integers(1, 30)),
        policy=st.sampled_from(sorted(EVICTION_POLICIES)),
    )
    def evict(self, pages: int, policy: str) -> None:
        """Every cached page is reachable by leaf-first eviction, whatever the policy, and the
        eviction frees exactly what a from-scratch sort of the leaves would have it free."""
        self.cache.set_policy(policy)
        evictable = self.cache.evictable_pages()
        assert evictable == self.pool.cached_pages  # nothing is pinned between steps
        pool, cache = copy.deepcopy((self.pool, self.cache))
        expected = evict_from_scratch(cache, pages)
        assert self.cache.evict(pages) == min(pages, evictable) == expected
        assert trees_of(self.cache) == trees_of(cache)
        assert self.pool.pages.map() == pool.pages.map()

    @rule(max_pages=st.integers(1, 8), segments=st.integers(2, 5))
    def move_pages(self, max_pages: int, segments: int) -> None:
        """A defragmentation step, then a resize (a shrink evacuates and may evict)."""
        self.defragmenter.step(max_pages)
        with contextlib.suppress(ResizeRefused):
            self.resizer.resize(segments * SEGMENT)

    @invariant()
    def pool_and_cache_agree(self) -> None:
        self.pool.invariants.check()
        self.cache.check()

    @invariant()
    def the_eviction_order_is_a_fresh_sort_of_the_evictable_leaves(self) -> None:
        assert self.cache.eviction_order() == evictable_leaves(self.cache)

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for name, request in self.running.items():
            pages = self.pool.table(name).pages
            assert self.storage.read(pages, len(request.tokens)) == request.tokens

    @invariant()
    def every_tree_page_holds_its_branch(self) -> None:
        for key in self.cache.partitions():
            tree = self.cache.tree(key)
            assert tree is not None
            for node in tree.nodes():
                branch: list[int] = []
                ancestor = node
                while ancestor is not None:
                    branch[:0] = ancestor.tokens
                    ancestor = ancestor.parent
                size = self.page
                first = node.start // size
                for index, page in enumerate(node.pages, first):
                    assert self.storage.slots[page] == branch[index * size : (index + 1) * size]


class PrefixReusePageSize1(PrefixReuse):
    page = 1


PrefixReuse.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
PrefixReusePageSize1.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None
)
TestPrefixReuse = PrefixReuse.TestCase
TestPrefixReusePageSize1 = PrefixReusePageSize1.TestCase
