"""Eviction under each policy, page by page, on one small scenario with the exact order expected.

The scenario (page size 4, one partition), built by `scenario`:

    tick 1  insert X = 1 1 1 1 2 2 2 2  in pages 0 1
    tick 2  insert Y = 1 1 1 1 3 3 3 3  computed in pages 2 3; the tree already has page 0 for
            the shared first page, so it takes page 3 only (page 2 is freed with Y)
    tick 3  insert Z = 5 5 5 5 5 5 5 5  in pages 4 5
    tick 4  X is matched; ticks 5, 6: Z is matched twice; tick 7: Y is matched

    [0, 4) 1 1 1 1 -> 0           created 1, last used 7, 2 hits
      [4, 8) 2 2 2 2 -> 1         X: created 1, last used 4, 1 hit
      [4, 8) 3 3 3 3 -> 3         Y: created 2, last used 7, 1 hit
    [0, 8) 5 5 5 5 5 5 5 5 -> 4 5 Z: created 3, last used 6, 2 hits

Evicting one page at a time, leaf first, last page of a leaf first:
- lru  (last used):             X's 1, Z's 5 4, Y's 3, then the shared page 0
- lfu  (hits, then last used):  X's 1, Y's 3, then page 0 (2 hits, used 7) and Z (2 hits, used
  6) are both leaves: Z's 5 4 first, page 0 last
- fifo (created):               X's 1, Y's 3, page 0 (created 1, with X), Z's 5 4
"""

import pytest

from kvctl.agent.pool import PagePool
from kvctl.agent.prefix import EVICTION_POLICIES, IsolationKey, PrefixCache

X = [1, 1, 1, 1, 2, 2, 2, 2]
Y = [1, 1, 1, 1, 3, 3, 3, 3]
Z = [5] * 8
END = [9]  # a query token past the cached part, so the whole sequence can match


def computed(pool: PagePool, cache: PrefixCache, key: IsolationKey, name: str, tokens: list[int]):
    """A request that computed `tokens` in fresh pages, then finished: returns its pages."""
    pages = list(pool.allocate(name, len(tokens)).pages)
    cache.insert(key, tokens, pages)
    pool.free(name)
    return pages


def scenario(policy: str) -> tuple[PagePool, PrefixCache, IsolationKey]:
    pool = PagePool(12, page_size=4)
    cache = PrefixCache(pool, policy)
    key = cache.key_for()
    assert computed(pool, cache, key, "x", X) == [0, 1]
    assert computed(pool, cache, key, "y", Y) == [2, 3]
    assert computed(pool, cache, key, "z", Z) == [4, 5]
    for tokens in (X, Z, Z, Y):
        cache.record(cache.match(key, tokens + END), len(tokens) + 1)
    assert cache.render(key) == "\n".join(
        [
            "[0, 4) 1 1 1 1 -> 0",
            "  [4, 8) 2 2 2 2 -> 1",
            "  [4, 8) 3 3 3 3 -> 3",
            "[0, 8) 5 5 5 5 5 5 5 5 -> 4 5",
        ]
    )
    assert (pool.cached_pages, pool.free_pages) == (5, 7)
    return pool, cache, key


def held_pages(cache: PrefixCache, key: IsolationKey) -> set[int]:
    tree = cache.tree(key)
    return set(tree.pages()) if tree is not None else set()


def eviction_order(pool: PagePool, cache: PrefixCache, key: IsolationKey) -> list[int]:
    order = []
    while pool.cached_pages:
        before = held_pages(cache, key)
        assert cache.evict(1) == 1
        (page,) = before - held_pages(cache, key)
        order.append(page)
        cache.check()
        pool.invariants.check()
    return order


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("lru", [1, 5, 4, 3, 0]), ("lfu", [1, 3, 5, 4, 0]), ("fifo", [1, 3, 0, 5, 4])],
)
def test_each_policy_evicts_leaf_first_in_its_documented_order(policy, expected) -> None:
    pool, cache, key = scenario(policy)
    assert eviction_order(pool, cache, key) == expected
    assert cache.stats().evictions == {
        name: 5 if name == policy else 0 for name in EVICTION_POLICIES
    }
    assert cache.partitions() == [] and pool.free_pages == 12


def test_eviction_never_frees_a_page_a_request_uses() -> None:
    pool, cache, key = scenario("lru")
    match = cache.match(key, X + END)
    pool.adopt("r", match.pages, match.tokens, len(X) + 1)  # uses pages 0 and 1
    assert cache.evictable_pages() == 3
    assert cache.evict(100) == 3  # Y's 3 and Z's 4 5: page 0 is shared by the request
    assert held_pages(cache, key) == {0, 1}
    assert [pool.pages.state(p).value for p in (0, 1)] == ["used", "used"]
    assert cache.evictable_pages() == 0 and cache.evict(1) == 0
    pool.free("r")
    assert cache.evictable_pages() == 2
    cache.check()
    pool.invariants.check()


def test_a_copy_on_write_source_is_pinned_until_its_copy_is_applied() -> None:
    pool, cache, key = scenario("lru")
    match = cache.match(key, [1, 1, 1, 1, 3, 3, 0])  # 6 tokens: page 0 and 2 tokens of page 3
    assert (match.tokens, match.pages, match.full_pages) == (6, [0, 3], 1)
    assert cache.evictable_pages(match) == 3  # adopting locks pages 0 and 3
    table, copies = pool.adopt("r", match.pages, match.tokens, 7)
    assert [(c.src, c.dst) for c in copies] == [(3, table.pages[1])]
    cache.pin([c.src for c in copies])
    assert pool.pages.state(3).value == "cached" and cache.evictable_pages() == 3
    assert cache.evict(100) == 3  # X's 1, Z's 4 5; not page 3 before its copy is made
    assert held_pages(cache, key) == {0, 3}
    cache.unpin_all()
    assert cache.evict(100) == 1
    assert held_pages(cache, key) == {0}
    cache.check()


def test_the_policy_can_change_at_run_time() -> None:
    pool, cache, key = scenario("lru")
    cache.set_policy("fifo")
    assert cache.policy == "fifo"
    assert eviction_order(pool, cache, key) == [1, 3, 0, 5, 4]
    assert cache.stats().evictions["fifo"] == 5
    with pytest.raises(ValueError, match="choose one of lru, lfu, fifo"):
        cache.set_policy("random")
    assert cache.policy == "fifo"


def test_allocations_evict_through_the_pool_when_short() -> None:
    pool, cache, key = scenario("lru")
    pool.allocate("big", 4 * 9)  # 9 pages: 7 free + 2 evicted (X's 1, then Z's 5)
    assert held_pages(cache, key) == {0, 3, 4}
    assert cache.stats().evictions["lru"] == 2
    cache.check()
    pool.invariants.check()


def test_the_unused_rest_of_a_partly_used_leaf_goes_before_older_leaves() -> None:
    pool = PagePool(12, page_size=4)
    cache = PrefixCache(pool, "lru")
    key = cache.key_for()
    computed(pool, cache, key, "long", [1] * 4 + [2] * 4 + [3] * 4)  # tick 1, pages 0 1 2
    computed(pool, cache, key, "other", [5] * 8)  # tick 2, pages 3 4
    cache.record(cache.match(key, [1, 1, 1, 1, 2, 0]), 6)  # tick 3 uses 5 tokens of "long"
    assert cache.render(key) == "\n".join(
        ["[0, 5) 1 1 1 1 2 -> 0", "  [5, 12) 2 2 2 3 3 3 3 -> 1 2", "[0, 8) 5 5 5 5 5 5 5 5 -> 3 4"]
    )
    # the rest of "long" was last used at tick 1, before "other" (tick 2); its first page at 3
    assert eviction_order(pool, cache, key) == [2, 1, 4, 3, 0]


def test_a_leaf_used_after_it_was_queued_moves_back_in_the_order() -> None:
    pool, cache, key = scenario("lru")
    cache.record(cache.match(key, X + END), len(X) + 1)  # tick 8: X and page 0 used again
    assert eviction_order(pool, cache, key) == [5, 4, 3, 1, 0]


def test_a_leaf_a_request_uses_is_set_aside_and_comes_back_when_it_is_free() -> None:
    pool, cache, key = scenario("fifo")
    match = cache.match(key, X + END)
    pool.adopt("r", match.pages, match.tokens, len(X) + 1)  # X (first in fifo order) in use
    cache.record(match, len(X) + 1)
    assert cache.evict(1) == 1 and held_pages(cache, key) == {0, 1, 4, 5}  # Y's 3 went
    cache.check()
    pool.free("r")
    assert cache.evict(1) == 1 and held_pages(cache, key) == {0, 4, 5}  # X's 1, first again
    cache.check()


def test_evicting_pops_a_few_entries_per_leaf_freed_not_every_leaf(monkeypatch) -> None:
    """The order is kept up to date, not rebuilt per eviction: freeing k one-page leaves out of
    500 computes O(k) priorities."""
    calls = 0
    priority = EVICTION_POLICIES["lru"].priority

    def counted(self, node):
        nonlocal calls
        calls += 1
        return priority(self, node)

    monkeypatch.setattr(EVICTION_POLICIES["lru"], "priority", counted)
    pool = PagePool(600, page_size=4)
    cache = PrefixCache(pool, "lru")
    key = cache.key_for()
    for i in range(500):
        computed(pool, cache, key, f"r{i}", [i] * 4)
    assert calls == 500  # one per new leaf
    calls = 0
    assert cache.evict(10) == 10
    assert calls <= 2 * 10
    assert held_pages(cache, key) == set(range(10, 500))  # the 10 least recently used
    cache.check()


@pytest.mark.parametrize("in_use", range(8))
def test_a_leaf_gives_up_only_the_pages_after_those_a_request_uses(in_use) -> None:
    """Between adopting a match and recording it the request uses a prefix of a leaf's pages
    (an allocation can evict right then); the pages after them can go, the others cannot."""
    pool = PagePool(16, page_size=1)
    cache = PrefixCache(pool, "lru")
    key = cache.key_for()
    assert computed(pool, cache, key, "a", list(range(8))) == list(range(8))
    if in_use:
        pool.adopt("r", list(range(in_use)), in_use, in_use)
    assert cache.evictable_pages() == 8 - in_use
    assert cache.evict(100) == 8 - in_use
    assert held_pages(cache, key) == set(range(in_use))
    cache.check()
    pool.invariants.check()
