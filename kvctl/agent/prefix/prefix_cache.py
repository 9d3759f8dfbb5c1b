"""Prefix reuse over the page pool: radix trees per isolation key, holds, eviction, accounting.

Levels, from the request down: a request's prompt is looked up in the tree of its *isolation
key* (model, cache salt, optionally sampling settings); the longest cached prefix gives *pages*
the request adopts (reference counted, read-only; a partly matched last page is copied first);
when the request finishes or is preempted its whole pages enter the tree and the cache takes a
*hold* on them in the pool, so they become `cached` (evictable) once no sequence uses them.

Why eviction can always reach every cached page: the pages running requests use form a prefix
of each branch (a request adopts a path from the root; its own pages enter the tree only when it
stops running), so below and after any cached page there are only cached pages, and leaf-first
eviction reaches all of them. `check` verifies this along with the holds, which is what makes
`evictable_pages` exact and lets the scheduler admit without ever hitting `PoolExhausted`.

A copy-on-write source must survive until storage has copied it, so the scheduler *pins* it for
the step that adopted it; eviction skips pinned pages.

Eviction takes leaves from an `EvictionOrder` the trees keep up to date (a new leaf is pushed,
uses cost nothing until the leaf comes first), so freeing pages costs O(log n) per leaf freed.
A leaf a request still uses comes out of the order, is set aside for the call and goes back.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol

from kvctl.agent.pool import PagePool, PageState
from kvctl.agent.pool.errors import PoolCorrupted
from kvctl.agent.prefix.eviction import EVICTION_POLICIES, EvictionOrder, make_policy
from kvctl.agent.prefix.radix_tree import PageOwners, RadixNode, RadixTree, relocate_pages
from kvctl.agent.prefix.residency import Residency
from kvctl.agent.prefix.window_pages import WindowPages

EVICTION_REASONS = ("allocation", "shrink", "clear", "sleep")
"""What needed the room: an allocation (a request's pages), a pool shrink, an explicit clear, a
model put to sleep."""


class PrefixIsolation(StrEnum):
    """What separates the partitions of the cache (`--prefix-isolation`)."""

    SALT = "salt"  # model + the request's cache_salt
    SAMPLING = "sampling"  # model + cache_salt + sampling settings


@dataclass(frozen=True)
class IsolationKey:
    """The partition a request may match in: pages never match across different keys.
    `group` is the layer group whose pages the partition holds (`layer_groups`: a model whose
    sliding and full layers keep separate pages has a partition per group)."""

    model: str
    salt: str | None = None
    sampling: Hashable | None = None
    group: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """A cached prefix of `tokens` positions held in `pages`; the last page is only partly
    matched when `tokens` is not a multiple of the page size, and is then copied on adoption."""

    key: IsolationKey
    tokens: int
    pages: list[int]
    page_size: int
    nodes: list[RadixNode] = field(repr=False)
    dropped: int = 0  # a sliding group's pages before its window: neither held nor needed

    @property
    def full_pages(self) -> int:
        """Page places the match fills (adopted, or before a window: never allocated); a partly
        matched page still needs a page for its copy."""
        return self.tokens // self.page_size


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters and sizes of one cache, read together."""

    policy: str
    queries_tokens: int  # prompt tokens looked up at admission
    hits_tokens: int  # of those, tokens served from the cache
    evictions: dict[str, int]  # pages evicted, per policy in force at the time
    held_pages: int  # pages the trees own (in use by requests or cached)
    partitions: int

    @property
    def hit_ratio(self) -> float | None:
        """hits / queries in tokens; None before the first query."""
        return self.hits_tokens / self.queries_tokens if self.queries_tokens else None

    @property
    def evictions_total(self) -> int:
        return sum(self.evictions.values())


class Spilled(NamedTuple):
    """Pages about to be evicted, while they still hold their K/V: `pages` are pages
    `first_page, ...` of a prompt of `key`'s partition whose tokens up to them are `tokens`."""

    key: IsolationKey
    tokens: list[int]
    first_page: int
    pages: list[int]


Spill = Callable[[list[Spilled]], None]
"""Where one eviction's pages go instead of being dropped (see `PrefixCache.spill`)."""


class PageEvents(Protocol):
    """Told of the pages the trees take and free, for the agent's KV events
    (kvctl/agent/observe/kv_events.py); unset, the cache pays one None check per insert and
    eviction."""

    def stored(self, key: IsolationKey, tokens: Sequence[int], first_page: int, pages: int) -> None:
        """Pages `first_page ... pages - 1` of `tokens` entered `key`'s tree."""

    def removed(self, runs: list[Spilled]) -> None:
        """One eviction's pages left the device (after `spill` has kept them)."""


@dataclass(frozen=True)
class CachedPrefix:
    """One cached prefix as a listing shows it: the tokens from the partition's root to the end
    of a tree leaf (whole pages), the pages holding them and when it was last used."""

    key: IsolationKey
    tokens: list[int]
    pages: int
    last_used_at: float | None


class PrefixCacheCorrupted(PoolCorrupted):
    """The trees disagree with the pool's holds: a bug, never a user error."""


class PrefixCache:
    """Token-level prefix reuse for one pool: match, insert, evict, follow page moves.

    It installs itself as the pool's evictor and relocation listener, so allocations that run
    short evict cached prefixes and the defragmenter's moves rename the trees' pages.
    """

    def __init__(
        self,
        pool: PagePool,
        policy: str = "lru",
        model: str = "",
        isolation: PrefixIsolation | str = PrefixIsolation.SALT,
        windows: Sequence[int | None] = (),
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`windows[g]`: the window of page group g's layers (None: full attention); the
        partitions of sliding groups keep their pages in `WindowPages`, the others in trees.
        `clock` times the nodes' uses (the residency figures, `residency`); `wall` turns those
        times into the wall-clock times a lookup or a listing shows."""
        self.pool = pool
        self._windows = tuple(windows)
        self._window_pages = WindowPages(pool)
        self.page_size = pool.page_size
        self.model = model
        self.isolation = PrefixIsolation(isolation)
        self._policy = make_policy(policy)
        self._order = EvictionOrder(self._policy)
        self._trees: dict[IsolationKey, RadixTree] = {}
        self._tree_keys: dict[int, IsolationKey] = {}  # id(tree) -> its partition
        self._owners = PageOwners(pool.capacity)  # every tree page -> its node
        self._held_pages = 0
        self._pinned: set[int] = set()
        self._clock = 0
        self.wall = wall
        self.clock = clock
        self.residency = Residency()  # page lifetime, idle time before eviction, reuse gap
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.evictions: Counter[str] = Counter({name: 0 for name in EVICTION_POLICIES})
        self.evictions_by_reason: Counter[str] = Counter({r: 0 for r in EVICTION_REASONS})
        self.spill: Spill | None = None  # where evicted pages go instead of being dropped
        self.events: PageEvents | None = None  # told of pages taken and freed (KV events)
        pool.set_evictor(self.evict)
        pool.relocation.add_listener(self._follow_moves)

    # ---- policy and keys ------------------------------------------------------------------

    @property
    def policy(self) -> str:
        return self._policy.name

    def set_policy(self, name: str) -> None:
        """Switch the eviction policy; takes effect at the next eviction."""
        policy = make_policy(name)
        if policy.name != self._policy.name:
            self._policy = policy
            self._order.rebuild(policy, self._leaves())

    def key_for(self, salt: str | None = None, sampling: Hashable | None = None) -> IsolationKey:
        """The partition of a request with this cache salt and these sampling settings."""
        if self.isolation is PrefixIsolation.SAMPLING:
            return IsolationKey(self.model, salt, sampling)
        return IsolationKey(self.model, salt)

    # ---- lookups --------------------------------------------------------------------------

    def window_of(self, key: IsolationKey) -> int | None:
        """The window of the layers whose pages `key`'s partition holds (None: all keys)."""
        return self._windows[key.group] if key.group < len(self._windows) else None

    def match(
        self, key: IsolationKey, tokens: Sequence[int], limit: int | None = None
    ) -> PrefixMatch:
        """The longest cached prefix of `tokens` in `key`'s partition, of at most `limit` tokens
        (default: leaving the last token to compute, whose logits give the next token).
        Changes nothing. In a sliding group's partition, a prefix of whole pages whose window
        is held (`WindowPages`)."""
        limit = len(tokens) - 1 if limit is None else min(limit, len(tokens))
        window = self.window_of(key)
        if window is not None:
            hit = self._window_pages.match(key, tokens, limit, window)
            return PrefixMatch(key, hit.tokens, hit.pages, self.page_size, [], hit.first_page)
        tree = self._trees.get(key)
        if tree is None or limit < 1:
            return PrefixMatch(key, 0, [], self.page_size, [])
        found = tree.match(tokens, limit)
        return PrefixMatch(key, found.tokens, found.pages, self.page_size, found.nodes)

    def record(self, match: PrefixMatch, query_tokens: int) -> None:
        """Count an admitted request's lookup and mark the prefix it used as used now (call it
        right after adopting the match, before anything else changes the tree)."""
        self.queries_tokens += query_tokens
        self.hits_tokens += match.tokens
        self.mark_used(match)

    def mark_used(self, match: PrefixMatch) -> None:
        """Mark the prefix `match` found as used now (another page group's part of a lookup
        `record` counted)."""
        if self.window_of(match.key) is not None:
            self._window_pages.touch(match.pages)
            return
        tree = self._trees.get(match.key)
        if match.nodes and tree is not None:
            self._clock += 1
            at = self.clock()
            last = match.nodes[-1].used_at
            if last:
                self.residency.reuse_gap.observe(at - last)
            tree.mark_used(match.nodes, match.tokens, self._clock, at)

    def last_used_at(self, match: PrefixMatch) -> float | None:
        """When the prefix `match` found was last used or stored (wall clock); None for a
        sliding group's match or no match."""
        return self._wall_time(match.nodes[-1].used_at) if match.nodes else None

    def _wall_time(self, at: float) -> float | None:
        """The wall-clock time of clock time `at` (None for a node never timed)."""
        return self.wall() - (self.clock() - at) if at else None

    def evictable_pages(self, *matches: PrefixMatch) -> int:
        """Cached pages eviction can free now, or once `matches` are adopted (adoption makes
        their pages used, and a pinned page waits for its copy)."""
        refcount = self.pool.pages.refcount
        blocked = {p for p in self._pinned if not refcount(p)}
        for match in matches:
            blocked.update(p for p in match.pages if not refcount(p))
        return self.pool.cached_pages - len(blocked)

    # ---- inserting ------------------------------------------------------------------------

    def insert(
        self, key: IsolationKey, tokens: Sequence[int], pages: Sequence[int], first: int = 0
    ) -> int:
        """Add a sequence's whole pages (those `tokens` fill) to `key`'s partition and hold the
        ones the tree did not have. Call it while the sequence still holds its pages. Returns
        the number of pages newly held. `first`: in a sliding group's partition, the pages
        before it are gone from the sequence (`pages` by token position)."""
        if self.window_of(key) is not None:
            ranges = self._window_pages.insert(key, tokens, pages, first)
            held = sum(end - start for start, end in ranges)
            self._held_pages += held
            if self.events is not None and key.group == 0:
                for start, end in ranges:
                    self.events.stored(key, tokens, start, end)
            return held
        page_size = self.page_size
        whole = min(len(tokens) // page_size, len(pages))
        if not whole:
            return 0
        tree = self._trees.get(key)
        if tree is None:
            tree = self._trees[key] = RadixTree(page_size, self._owners, self._order.add)
            self._tree_keys[id(tree)] = key
        self._clock += 1
        taken = tree.insert(tokens, pages, self._clock, whole, self.clock())
        if taken:
            self.pool.holds.hold(taken)
            self._held_pages += len(taken)
            if self.events is not None and key.group == 0:  # the last pages of the `whole`
                self.events.stored(key, tokens, whole - len(taken), whole)
        return len(taken)

    # ---- pins -----------------------------------------------------------------------------

    def pin(self, pages: Sequence[int]) -> None:
        """Keep `pages` from eviction until `unpin_all` (copy-on-write sources of this step)."""
        self._pinned.update(pages)

    def unpin_all(self) -> None:
        self._pinned.clear()

    # ---- eviction -------------------------------------------------------------------------

    def evict(self, num_pages: int, reason: str = "allocation") -> int:
        """Free at least `num_pages` cached pages if that many can go, leaf-first in policy order;
        return how many were freed. Pages a request uses and pinned pages are never freed.
        `reason` (EVICTION_REASONS) is what needed the room, counted per page."""
        order, release = self._order, self.pool.holds.release
        set_aside: list[tuple[RadixNode, RadixTree]] = []
        spilled: list[Spilled] = []
        freed = 0
        if len(self._window_pages):  # sliding groups' pages first: any of them can go
            for key, tokens, index, page in self._window_pages.evict(num_pages, self._pinned):
                spilled.append(Spilled(key, tokens, index, [page]))
            freed = len(spilled)
        while freed < num_pages:
            first = order.pop()
            if first is None:
                break
            leaf, tree = first
            count = min(self._evictable_tail(leaf), num_pages - freed)
            if not count:
                set_aside.append(first)
                continue
            self._leaving(leaf, tree, count, spilled)
            dropped, remaining = tree.drop_last_pages(leaf, count)
            release(dropped)
            freed += count
            if remaining is leaf:
                set_aside.append(first)
            elif tree.is_empty:
                self._drop_partition(tree)
        for leaf, tree in set_aside:
            order.add(leaf, tree)
        if spilled and self.spill is not None:  # freed pages keep their K/V until reallocated
            self.spill(spilled)
        if spilled and self.events is not None:  # after the spill: the tiers hold them first
            self.events.removed([s for s in spilled if s.key.group == 0])
        self.evictions[self._policy.name] += freed
        self.evictions_by_reason[reason] += freed
        self._held_pages -= freed
        return freed

    def _leaving(
        self, leaf: RadixNode, tree: RadixTree, count: int, spilled: list[Spilled]
    ) -> None:
        """The last `count` pages of `leaf` are about to be evicted: time them, and note them
        for the tiers and the KV events."""
        if leaf.stored_at:
            at = self.clock()
            self.residency.lifetime.observe(at - leaf.stored_at, count)
            self.residency.idle_before_evict.observe(at - leaf.used_at, count)
        if self.spill is not None or self.events is not None:
            spilled.append(self._spilled(self._key_of(tree), leaf, count))

    def _spilled(self, key: IsolationKey, leaf: RadixNode, count: int) -> Spilled:
        """The last `count` pages of `leaf` as the tiers and the KV events take them."""
        start = leaf.end // self.page_size - count
        return Spilled(key, _path_tokens(leaf), start, leaf.pages[-count:])

    def _evictable_tail(self, leaf: RadixNode) -> int:
        """How many of the leaf's last pages eviction may free: those after its last page in use
        (pages in use are a prefix of every node's pages, which `check` verifies) and after its
        last pinned page."""
        pages = leaf.pages
        refcount = self.pool.pages.refcount
        n = len(pages)
        if refcount(pages[-1]):
            return 0
        if refcount(pages[0]):
            used, unused = 0, n - 1  # pages[used] is in use, pages[unused] is not
            while unused - used > 1:
                middle = (used + unused) // 2
                if refcount(pages[middle]):
                    used = middle
                else:
                    unused = middle
            n -= unused
        for page in self._pinned:
            if page in pages:
                n = min(n, len(pages) - 1 - pages.index(page))
        return n

    def _drop_partition(self, tree: RadixTree) -> None:
        del self._trees[self._tree_keys.pop(id(tree))]

    def _key_of(self, tree: RadixTree) -> IsolationKey:
        return self._tree_keys[id(tree)]

    def _leaves(self) -> list[tuple[RadixNode, RadixTree]]:
        return [(leaf, tree) for tree in self._trees.values() for leaf in tree.leaves]

    def eviction_order(self) -> list[tuple[IsolationKey, RadixNode]]:
        """The leaves eviction can free a page of now, in the order it would take them (for
        checks: it walks the whole order)."""
        keys = {id(tree): key for key, tree in self._trees.items()}
        return [
            (keys[id(tree)], leaf)
            for leaf, tree in self._order.ordered()
            if self._evictable_tail(leaf)
        ]

    def clear(self) -> int:
        """Evict every page no request uses; return how many were freed."""
        return self.evict(self.pool.cached_pages, "clear")

    def drop(self, keys: Collection[IsolationKey]) -> int:
        """Free every page of `keys`' partitions that no request uses, without handing them to
        the tiers (a purge: what is dropped must be gone); return how many were freed. Pages
        requests use stay, and enter the cache again when those requests end."""
        gone = self._window_pages.evict(len(self._window_pages), self._pinned, set(keys))
        dropped = [Spilled(key, tokens, index, [page]) for key, tokens, index, page in gone]
        freed = len(gone)
        for key in keys:
            tree = self._trees.get(key)
            if tree is None:
                continue
            freed += self._drop_tree(key, tree, dropped)
            if tree.is_empty:
                self._drop_partition(tree)
        if dropped and self.events is not None:
            self.events.removed([s for s in dropped if s.key.group == 0])
        self._held_pages -= freed
        return freed

    def _drop_tree(self, key: IsolationKey, tree: RadixTree, dropped: list[Spilled]) -> int:
        """Free every page of one tree that no request uses, leaf by leaf until none can go."""
        freed, progress = 0, True
        while progress:
            progress = False
            for leaf in list(tree.leaves):
                count = self._evictable_tail(leaf) if leaf.parent is not None else 0
                if not count:
                    continue
                dropped.append(self._spilled(key, leaf, count))
                pages, _ = tree.drop_last_pages(leaf, count)
                self.pool.holds.release(pages)
                freed += count
                progress = True
        return freed

    def largest(self, count: int) -> list[CachedPrefix]:
        """The `count` longest cached prefixes (the paths to the trees' leaves), longest first."""
        leaves = [
            (leaf.end, key, leaf) for key, tree in self._trees.items() for leaf in tree.leaves
        ]
        out: list[CachedPrefix] = []
        for _, key, leaf in heapq.nlargest(count, leaves, key=lambda item: item[0]):
            pages = 0
            node: RadixNode | None = leaf
            while node is not None:
                pages += len(node.pages)
                node = node.parent
            out.append(CachedPrefix(key, _path_tokens(leaf), pages, self._wall_time(leaf.used_at)))
        return out

    # ---- page moves -----------------------------------------------------------------------

    def _follow_moves(self, moves: dict[int, int]) -> None:
        relocate_pages(self._owners, moves)
        self._window_pages.follow_moves(moves)
        if self._pinned:
            self._pinned = {moves.get(p, p) for p in self._pinned}

    # ---- reading --------------------------------------------------------------------------

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            policy=self._policy.name,
            queries_tokens=self.queries_tokens,
            hits_tokens=self.hits_tokens,
            evictions=dict(self.evictions),
            held_pages=self._held_pages,
            partitions=len(self._trees),
        )

    def partitions(self) -> list[IsolationKey]:
        return list(self._trees)

    def window_partitions(self) -> list[IsolationKey]:
        """The partitions of sliding groups that hold pages."""
        return self._window_pages.keys()

    def pages_of(self, keys: Collection[IsolationKey]) -> int:
        """Pages the partitions `keys` hold (in use or cached)."""
        held = sum(len(list(tree.pages())) for key, tree in self._trees.items() if key in keys)
        return held + self._window_pages.count_of(keys)

    def tree(self, key: IsolationKey) -> RadixTree | None:
        """The partition's tree, for reading (None when nothing is cached under `key`)."""
        return self._trees.get(key)

    def render(self, key: IsolationKey) -> str:
        """The partition's tree, one node per line (see `RadixTree.render`)."""
        tree = self._trees.get(key)
        return tree.render() if tree is not None else ""

    def check(self) -> None:
        """Raise `PrefixCacheCorrupted`, naming every `problems()`, unless the trees and the
        pool agree."""
        problems = self.problems()
        if problems:
            raise PrefixCacheCorrupted("; ".join(problems))

    def problems(self) -> list[str]:
        """Every way the trees and the pool disagree, described (empty when they agree).

        Checks each tree's own structure; that no page is in two places; that every tree page
        is held (not free) and every cached page of the pool is in a tree; that pins are tree
        pages; and that the pages in use form a prefix of every branch (what makes every cached
        page reachable by leaf-first eviction).
        """
        problems: list[str] = []
        tree_pages: list[int] = []
        if self._order.policy.name != self._policy.name:
            problems.append("the eviction order follows another policy")
        problems.extend(self._order.problems(self._leaves()))
        for key, tree in self._trees.items():
            problems.extend(f"{key}: {problem}" for problem in tree.problems())
            if tree.is_empty:
                problems.append(f"{key}: an empty partition is kept")
            tree_pages.extend(tree.pages())
            problems.extend(self._used_prefix_problems(tree))
        if set(tree_pages) != set(self._owners):
            problems.append("the page index differs from the trees")
        problems.extend(self._window_pages.problems())
        tree_pages.extend(self._window_pages.pages())
        held = set(tree_pages)
        if len(held) != len(tree_pages):
            problems.append("a page is owned by two nodes")
        if len(tree_pages) != self._held_pages:
            problems.append(
                f"{self._held_pages} pages counted as held, the trees own {len(tree_pages)}"
            )
        problems.extend(
            f"page {p} is in a tree but free in the pool"
            for p in sorted(held)
            if self.pool.pages.state(p) is PageState.FREE
        )
        cached = {
            page
            for run in self.pool.pages.map()
            if run.state is PageState.CACHED
            for page in range(run.start, run.start + run.length)
        }
        problems.extend(f"page {p} is cached in the pool but in no tree" for p in cached - held)
        if not self._pinned <= held:
            problems.append(f"pinned pages {sorted(self._pinned - held)} are in no tree")
        return problems

    def _used_prefix_problems(self, tree: RadixTree) -> list[str]:
        problems: list[str] = []
        used = self.pool.pages.refcount
        for node in tree.nodes():
            flags = [bool(used(p)) for p in node.pages]
            if flags != sorted(flags, reverse=True):
                problems.append(f"node {node.node_id}: a cached page comes before a used one")
            ancestor = node.parent
            while any(flags) and ancestor is not None:
                if not all(used(p) for p in ancestor.pages):
                    problems.append(f"node {node.node_id} is used below a cached page")
                    break
                ancestor = ancestor.parent
        return problems


def _path_tokens(node: RadixNode) -> list[int]:
    """The tokens from the root to the end of `node`'s edge."""
    edges = []
    current: RadixNode | None = node
    while current is not None:
        edges.append(current.tokens)
        current = current.parent
    return [t for edge in reversed(edges) for t in edge]
