"""A sliding-window group's cached pages: a prefix is found as far as its window is held, any
cached page can go on its own (least recently used first), and partitions never share."""

from __future__ import annotations

from kvctl.agent.pool import PagePool
from kvctl.agent.prefix import IsolationKey, PrefixCache

PAGE = 4
WINDOW = 8  # a query reads its own key and the 7 before it: at most 3 pages


def _cache() -> tuple[PagePool, PrefixCache, IsolationKey]:
    pool = PagePool(32, PAGE)
    cache = PrefixCache(pool, model="m", windows=(None, WINDOW))
    return pool, cache, IsolationKey("m", group=1)


def _computed(pool: PagePool, cache: PrefixCache, key: IsolationKey, tokens: list[int]) -> list:
    """A sequence computes `tokens` in group 1's pages, offers them and ends."""
    table = pool.allocate(("seq", tuple(tokens)), len(tokens))
    pages = list(table.pages)
    cache.insert(key, tokens, pages)
    pool.free(table.seq_id)
    cache.check()
    return pages


def test_a_prefix_is_found_whole_while_its_window_is_held() -> None:
    pool, cache, key = _cache()
    tokens = list(range(100, 124))  # 6 pages
    pages = _computed(pool, cache, key, tokens)
    asked = [*tokens, 7]
    match = cache.match(key, asked)
    assert (match.tokens, match.dropped, match.pages) == (24, 4, pages[4:])
    # the two oldest pages go (least recently used): the window of 24 tokens is still held
    assert cache.evict(2) == 2
    assert cache.match(key, asked).tokens == 24
    cache.check()


def test_a_missing_window_page_cuts_the_match_before_it() -> None:
    pool, cache, key = _cache()
    tokens = list(range(100, 124))
    pages = _computed(pool, cache, key, tokens)
    twelve = cache.match(key, tokens[:13])  # 12 tokens: its window is pages 1-2
    assert (twelve.tokens, twelve.pages) == (12, pages[1:3])
    cache.mark_used(twelve)  # pages 1-2 used now: 0, 3, 4 and 5 are older
    assert cache.evict(3) == 3  # 0, 3 and 4 go: 24 tokens would read page 4, 16 and 20 page 3
    match = cache.match(key, [*tokens, 7])
    assert (match.tokens, match.dropped, match.pages) == (12, 1, pages[1:3])
    cache.check()


def test_partitions_and_the_full_groups_tree_do_not_share() -> None:
    pool, cache, key = _cache()
    tokens = list(range(100, 124))
    _computed(pool, cache, key, tokens)
    for other in (IsolationKey("m", salt="tenant-b", group=1), IsolationKey("m", group=0)):
        assert cache.match(other, [*tokens, 7]).tokens == 0


def test_a_page_in_use_is_never_evicted() -> None:
    pool, cache, key = _cache()
    tokens = list(range(100, 116))
    table = pool.allocate("running", len(tokens))
    cache.insert(key, tokens, table.pages)
    assert cache.evict(4) == 0  # all four are the running sequence's
    pool.release_front("running", 2)  # its window moved on: those two are cached now
    assert cache.evict(4) == 2
    cache.check()
