"""The prefix cache's pages of sliding-window layer groups: each held under its token chain's
digest and evictable on its own, least recently used first.

The radix tree frees pages leaf first, so a page it holds stays until every page after it on
the path has gone; that is what prefix reuse needs when every layer reads every earlier key. A
sliding-window layer reads only the last `window` keys, and its request gives its front pages
back while it runs: in a tree those pages would hang above the ones still in use, unreachable
for eviction. So the sliding groups' cached pages are kept apart, by the digest of the tokens
up to and including each page (chained from the partition, as the tiers name pages), and any
of them that no request uses can go. A lookup finds the longest prefix whose window is held:
the pages from the one holding its first visible key to its end, whatever came before (vLLM's
sliding-window manager looks blocks up the same way).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvctl.agent.pool import PagePool

if TYPE_CHECKING:
    from kvctl.agent.prefix.prefix_cache import IsolationKey

DIGEST_BYTES = 16
Evicted = tuple["IsolationKey", list[int], int, int]
"""An evicted page: its partition, the tokens up to and including it, its index, its id."""


@dataclass(frozen=True)
class WindowHit:
    """`tokens` matched (whole pages); `pages` hold pages `first_page ...` of them, the ones a
    window at the end of the match reads (the ones before need not be held)."""

    tokens: int
    first_page: int
    pages: list[int]


@dataclass(frozen=True)
class _Entry:
    key: IsolationKey  # the partition (an IsolationKey)
    digest: bytes
    tokens: list[int]  # the tokens of the page's chain, up to and including its own
    index: int  # the page's place in its chain


class WindowPages:
    """Cached pages by chain digest, in least-recently-used order (oldest first)."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._pages: dict[bytes, int] = {}  # digest -> page
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # page -> entry, LRU first
        self._roots: dict[IsolationKey, bytes] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def pages(self) -> list[int]:
        return list(self._entries)

    def keys(self) -> list[IsolationKey]:
        """The partitions holding pages."""
        return list({entry.key: None for entry in self._entries.values()})

    def count_of(self, keys: Collection[IsolationKey]) -> int:
        """Pages the partitions `keys` hold."""
        return sum(entry.key in keys for entry in self._entries.values())

    def _digests(self, key: IsolationKey, tokens: Sequence[int], pages: int) -> list[bytes]:
        root = self._roots.get(key)
        if root is None:
            text = repr(key).encode()
            root = self._roots[key] = hashlib.blake2b(text, digest_size=DIGEST_BYTES).digest()
        size, previous, out = self.page_size, root, []
        for k in range(pages):
            chunk = array("q", tokens[k * size : (k + 1) * size]).tobytes()
            previous = hashlib.blake2b(previous + chunk, digest_size=DIGEST_BYTES).digest()
            out.append(previous)
        return out

    def match(self, key: IsolationKey, tokens: Sequence[int], limit: int, window: int) -> WindowHit:
        """The longest whole-page prefix of `tokens`, at most `limit` tokens, whose window
        (keys from `limit - window + 1` on, page by page) is held. Changes nothing."""
        count = min(limit, len(tokens)) // self.page_size
        held = [self._pages.get(d) for d in self._digests(key, tokens, count)]
        run = 0  # held pages ending at page j - 1
        runs = [0]
        for page in held:
            run = run + 1 if page is not None else 0
            runs.append(run)
        for j in range(count, 0, -1):
            first = max(0, j * self.page_size - window + 1) // self.page_size
            if first < j and runs[j] >= j - first:
                pages = [p for p in held[first:j] if p is not None]
                return WindowHit(j * self.page_size, first, pages)
        return WindowHit(0, 0, [])

    def touch(self, pages: Sequence[int]) -> None:
        """Mark pages as used now (a lookup adopted them)."""
        entries = self._entries
        for page in pages:
            if page in entries:
                entries.move_to_end(page)

    def insert(
        self, key: IsolationKey, tokens: Sequence[int], pages: Sequence[int], first: int = 0
    ) -> list[tuple[int, int]]:
        """Hold the whole pages `first ...` of a sequence's table (`pages` by token position)
        that no page with the same chain is held for; the (start, end) page ranges taken."""
        whole = min(len(tokens) // self.page_size, len(pages))
        if whole <= first:
            return []
        chain = list(tokens[: whole * self.page_size])
        taken: list[int] = []
        ranges: list[tuple[int, int]] = []
        for index, digest in enumerate(self._digests(key, chain, whole)):
            if index < first:
                continue
            existing = self._pages.get(digest)
            if existing is not None:
                self._entries.move_to_end(existing)
                continue
            page = pages[index]
            self._pages[digest] = page
            self._entries[page] = _Entry(key, digest, chain, index)
            taken.append(page)
            if ranges and ranges[-1][1] == index:
                ranges[-1] = (ranges[-1][0], index + 1)
            else:
                ranges.append((index, index + 1))
        if taken:
            self.pool.holds.hold(taken)
        return ranges

    def evict(
        self, num_pages: int, pinned: set[int], keys: Collection[IsolationKey] | None = None
    ) -> list[Evicted]:
        """Free up to `num_pages` held pages no request uses and no copy waits for, least
        recently used first (only of `keys`' partitions when given); (key, tokens up to the
        page, its index, page) of each, whose K/V stay in place until the page is taken again."""
        refcount = self.pool.pages.refcount
        victims: list[int] = []
        for page, entry in self._entries.items():
            if len(victims) == num_pages:
                break
            if keys is not None and entry.key not in keys:
                continue
            if not refcount(page) and page not in pinned:
                victims.append(page)
        if not victims:
            return []
        gone = []
        for page in victims:
            entry = self._entries.pop(page)
            del self._pages[entry.digest]
            tokens = entry.tokens[: (entry.index + 1) * self.page_size]
            gone.append((entry.key, tokens, entry.index, page))
        self.pool.holds.release(victims)
        return gone

    def follow_moves(self, moves: dict[int, int]) -> None:
        """The defragmenter moved pages: hold them under their new ids."""
        if not any(page in self._entries for page in moves):
            return
        entries: OrderedDict[int, _Entry] = OrderedDict()
        for page, entry in self._entries.items():
            moved = moves.get(page, page)
            entries[moved] = entry
            self._pages[entry.digest] = moved
        self._entries = entries

    def problems(self) -> list[str]:
        """Where the held pages disagree with the pool's holds (empty when they agree)."""
        problems = []
        cached = self.pool._cached
        for page, entry in self._entries.items():
            if self._pages.get(entry.digest) != page:
                problems.append(f"window page {page} is not the one held for its digest")
            if not cached[page]:
                problems.append(f"window page {page} is not held in the pool")
        if len(self._pages) != len(self._entries):
            problems.append("window pages: digests and pages differ in number")
        return problems
