"""The prefix cache over a pool: hit accounting, isolation, page moves and the consistency check."""

import pytest

from kvctl.agent.pool import Defragmenter, PagePool
from kvctl.agent.prefix import IsolationKey, PrefixCache, PrefixCacheCorrupted


def admit(pool: PagePool, cache: PrefixCache, key: IsolationKey, name: str, prompt: list[int]):
    """What the scheduler does: match, adopt (or allocate), count; returns the match."""
    match = cache.match(key, prompt)
    if match.tokens:
        pool.adopt(name, match.pages, match.tokens, len(prompt))
    else:
        pool.allocate(name, len(prompt))
    cache.record(match, len(prompt))
    return match


def finish(pool: PagePool, cache: PrefixCache, key: IsolationKey, name: str, tokens: list[int]):
    cache.insert(key, tokens, pool.table(name).pages)
    pool.free(name)


def test_hit_accounting_on_a_hand_computed_scenario() -> None:
    pool = PagePool(32, page_size=4)
    cache = PrefixCache(pool, model="demo")
    key = cache.key_for()
    first = list(range(10, 22))  # 12 tokens: 3 whole pages once computed
    # 1. nothing cached: 10 tokens queried, 0 hit; it computes 12 tokens and finishes
    assert admit(pool, cache, key, "a", first[:10]).tokens == 0
    pool.append("a", 2)
    finish(pool, cache, key, "a", first)
    # 2. shares 6 tokens, diverging inside page 1: 6 hit (page 0 whole, page 1 copied)
    assert admit(pool, cache, key, "b", [*first[:6], 0, 0, 0, 0]).tokens == 6
    # 3. the same 12 tokens: 11 hit, the last one is computed for its logits
    assert admit(pool, cache, key, "c", first).tokens == 11
    # 4. the same tokens under another salt: nothing
    other = cache.key_for(salt="tenant-b")
    assert admit(pool, cache, other, "d", first).tokens == 0
    stats = cache.stats()
    assert (stats.queries_tokens, stats.hits_tokens) == (10 + 10 + 12 + 12, 0 + 6 + 11 + 0)
    assert stats.hit_ratio == 17 / 44
    assert stats.held_pages == 3 and stats.partitions == 1


def test_different_salts_never_share_pages() -> None:
    pool = PagePool(32, page_size=4)
    cache = PrefixCache(pool, model="demo")
    prompt = list(range(9))
    for salt in ("a", "b", None):
        key = cache.key_for(salt)
        assert admit(pool, cache, key, f"req-{salt}", prompt).tokens == 0
        finish(pool, cache, key, f"req-{salt}", prompt)
    keys = cache.partitions()
    assert keys == [IsolationKey("demo", "a"), IsolationKey("demo", "b"), IsolationKey("demo")]
    pages = [set(cache.tree(k).pages()) for k in keys]
    assert all(len(p) == 2 for p in pages) and len(pages[0] | pages[1] | pages[2]) == 6
    assert cache.match(cache.key_for("a"), prompt).pages == sorted(pages[0])
    assert cache.match(cache.key_for("c"), prompt).tokens == 0
    cache.check()


def test_sampling_isolation_adds_the_sampling_settings_to_the_key() -> None:
    pool = PagePool(32, page_size=4)
    by_salt = PrefixCache(pool, isolation="salt")
    assert by_salt.key_for("s", (0.7, 1.0, 0, None)) == by_salt.key_for("s", (0.0, 1.0, 0, None))
    strict = PrefixCache(PagePool(32, page_size=4), isolation="sampling")
    assert strict.key_for("s", (0.7, 1.0, 0, None)) != strict.key_for("s", (0.0, 1.0, 0, None))
    with pytest.raises(ValueError):
        PrefixCache(pool, isolation="tenant")


def test_a_whole_prompt_never_matches_completely() -> None:
    pool = PagePool(8, page_size=4)
    cache = PrefixCache(pool)
    key = cache.key_for()
    admit(pool, cache, key, "a", [1, 2, 3, 4])
    finish(pool, cache, key, "a", [1, 2, 3, 4])
    match = cache.match(key, [1, 2, 3, 4])
    assert (match.tokens, match.pages, match.full_pages) == (3, [0], 0)  # page 0 is copied
    assert cache.match(key, [1]).tokens == 0


def test_the_tree_follows_the_defragmenter_and_stays_consistent() -> None:
    pool = PagePool(16, page_size=4)
    cache = PrefixCache(pool)
    key = cache.key_for()
    pool.allocate("filler", 4 * 6)  # pages 0-5
    admit(pool, cache, key, "a", list(range(8)))  # pages 6 7
    finish(pool, cache, key, "a", list(range(8)))
    admit(pool, cache, key, "b", [*range(6), 50, 51, 52])  # adopts 6 7, copies 7
    assert pool.table("b").pages == [6, 8, 9]
    pool.free("filler")
    cache.pin([7])
    report = Defragmenter(pool).run("manual")
    # 4 occupied pages compact into 0-3, paired in ascending order so runs stay runs: 6→0,
    # 7→1, 8→2, 9→3; the request's table, the tree and the pin all follow
    assert (report.complete, report.pages_moved) == (True, 4)
    assert pool.table("b").pages == [0, 2, 3]
    # b's use split the node where its match ended (position 6)
    assert cache.render(key) == "[0, 6) 0 1 2 3 4 5 -> 0\n  [6, 8) 6 7 -> 1"
    assert cache.evictable_pages() == 0  # the pinned page 7 is page 1 now
    cache.unpin_all()
    assert cache.evictable_pages() == 1
    cache.check()
    pool.invariants.check()


def cached_sequence(page_size: int = 4) -> tuple[PagePool, PrefixCache]:
    pool = PagePool(8, page_size)
    cache = PrefixCache(pool)
    key = cache.key_for()
    admit(pool, cache, key, "a", list(range(8)))
    finish(pool, cache, key, "a", list(range(8)))
    cache.check()
    return pool, cache


def test_check_finds_a_tree_page_the_pool_freed() -> None:
    pool, cache = cached_sequence()
    pool.holds.release([1])  # behind the cache's back
    with pytest.raises(PrefixCacheCorrupted, match="page 1 is in a tree but free"):
        cache.check()


def test_check_finds_a_cached_page_no_tree_holds() -> None:
    pool, cache = cached_sequence()
    pool.allocate("b", 4)
    pool.holds.hold(pool.table("b").pages)  # behind the cache's back
    pool.free("b")
    with pytest.raises(PrefixCacheCorrupted, match="page 2 is cached in the pool but in no tree"):
        cache.check()


def test_check_finds_a_used_page_below_a_cached_one() -> None:
    pool, cache = cached_sequence()
    pool.adopt("b", [1], 4, 4)  # page 1 without page 0: no request can do that by matching
    with pytest.raises(PrefixCacheCorrupted, match="a cached page comes before a used one"):
        cache.check()


def test_at_page_size_1_the_tree_follows_moves_after_evictions_reused_its_pages() -> None:
    """Pages that left the tree keep stale index entries until read; a move of such a page
    (now another sequence's) must not touch the tree."""
    pool = PagePool(24, page_size=1)
    cache = PrefixCache(pool)
    key = cache.key_for()
    admit(pool, cache, key, "a", list(range(10)))  # pages 0-9
    finish(pool, cache, key, "a", list(range(10)))
    admit(pool, cache, key, "b", [*range(4), 50, 51, 52, 53])  # adopts 0-3, pages 10-13
    finish(pool, cache, key, "b", [*range(4), 50, 51, 52, 53])
    assert cache.evict(6) == 6  # a's tail, pages 4-9 (b was used later)
    pool.allocate("filler", 6)  # takes pages 4-9 back, now outside the tree
    assert cache.stats().held_pages == 8
    report = Defragmenter(pool).run("manual")
    assert report.complete
    cache.check()
    pool.invariants.check()
    match = cache.match(key, [*range(4), 50, 51, 52, 53, 0])
    assert match.tokens == 8 and sorted(match.pages) == sorted(cache.tree(key).pages())
    assert not set(match.pages) & set(pool.table("filler").pages)
