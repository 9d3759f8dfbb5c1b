"""One invariant convention: every consistency check raises a typed `InvariantViolated`.

Each structure's `check` (or precondition) is broken on purpose here and must raise its own
subclass of `InvariantViolated` (an `AssertionError`, so hypothesis machines report it as a
failed invariant), never a bare `assert`: `python -O` strips those, so the same breakages run
again in an interpreter started with -O.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.agent.budget import BudgetCorrupted, KvBudget
from kvctl.agent.pool import (
    Defragmenter,
    FreeExtents,
    InvariantViolated,
    PagePool,
    PoolCorrupted,
    PoolResizer,
)
from kvctl.agent.prefix import PrefixCache, PrefixCacheCorrupted, RadixTree, RadixTreeCorrupted
from kvctl.agent.prefix.eviction import make_policy
from kvctl.agent.tiers import TierCorrupted, TierIndex
from kvctl.simulate.contiguous import ArenaCorrupted, ContiguousAllocator

TESTS = Path(__file__).resolve().parent


def break_page_pool() -> None:
    """A page's reference count raised behind the pool's back."""
    pool = PagePool(16, 4)
    pool.allocate("a", 8)
    pool.invariants.check()
    pool._ref[5] += 1
    pool.invariants.check()


def break_tier_index() -> None:
    """Two pages of a tier filed in one slot."""
    index = TierIndex(4, make_policy("lru"))
    first, second = index.add([b"a" * 32, b"b" * 32])
    index.check()
    second.slot = first.slot
    index.check()


def break_radix_tree() -> None:
    """A node that owns a page its tokens do not reach."""
    tree = RadixTree(page_size=4)
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11], now=1)
    tree.root.children[1].pages.append(12)
    tree.check()


def break_prefix_cache() -> None:
    """The pool frees a page the cache's tree still holds, behind the cache's back."""
    pool = PagePool(8, 4)
    cache = PrefixCache(pool)
    key = cache.key_for()
    pool.allocate("a", 8)
    cache.insert(key, list(range(8)), pool.table("a").pages)
    pool.free("a")
    cache.check()
    pool.holds.release([1])
    cache.check()


def _budget_of(pages: int, floor: int, ceiling: int) -> tuple[KvBudget, PagePool]:
    budget = KvBudget(64 * 100)
    pool = PagePool(pages, 4, 4, 100)
    budget.add("a", PoolResizer(pool, Defragmenter(pool), min_pages=floor, max_pages=ceiling))
    budget.check()
    return budget, pool


def break_budget_over_its_total() -> None:
    """A pool grown behind the budget's back, past what the budget holds."""
    budget, pool = _budget_of(16, 4, 128)
    pool.sizing.grow(64)
    budget.check()


def break_budget_below_a_floor() -> None:
    """A pool's floor raised above its size."""
    budget, _ = _budget_of(16, 4, 32)
    budget.pools["a"].resizer.min_pages = 32
    budget.check()


def break_extents_take_range() -> None:
    """Taking pages that are not free."""
    extents = FreeExtents()
    extents.give_now(0, 4)
    extents.take_range(2, 4)


def break_extents_take_scattered() -> None:
    """Taking more pages than are free."""
    extents = FreeExtents()
    extents.give_now(0, 4)
    extents.take_scattered(5)


def break_arena() -> None:
    """The simulator's contiguous arena with its used counter off."""
    arena = ContiguousAllocator(100)
    arena.check_invariants()
    arena.used_bytes += 1
    arena.check_invariants()


BREAKAGES: dict[str, tuple[Callable[[], None], type[InvariantViolated], str]] = {
    "page_pool": (break_page_pool, PoolCorrupted, "reference counts differ"),
    "tier_index": (break_tier_index, TierCorrupted, "two pages share a slot"),
    "radix_tree": (break_radix_tree, RadixTreeCorrupted, "owns 3 pages"),
    "prefix_cache": (break_prefix_cache, PrefixCacheCorrupted, "page 1 is in a tree but free"),
    "budget_total": (break_budget_over_its_total, BudgetCorrupted, "over the budget"),
    "budget_floor": (break_budget_below_a_floor, BudgetCorrupted, "a: 16 below its floor"),
    "extents_range": (break_extents_take_range, PoolCorrupted, "are not all free"),
    "extents_scattered": (break_extents_take_scattered, PoolCorrupted, "5 pages asked, 4 free"),
    "arena": (break_arena, ArenaCorrupted, "used counter differs"),
}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_each_check_raises_its_typed_error(name: str) -> None:
    breaker, error, message = BREAKAGES[name]
    with pytest.raises(error, match=message) as raised:
        breaker()
    assert isinstance(raised.value, InvariantViolated)
    assert isinstance(raised.value, AssertionError)


def test_the_typed_errors_name_their_structure() -> None:
    assert issubclass(PoolCorrupted, InvariantViolated)
    assert issubclass(PrefixCacheCorrupted, PoolCorrupted)  # the trees disagree with the pool
    assert issubclass(RadixTreeCorrupted, InvariantViolated)
    assert issubclass(BudgetCorrupted, InvariantViolated)
    assert issubclass(ArenaCorrupted, InvariantViolated)
    assert issubclass(TierCorrupted, InvariantViolated)
    assert not issubclass(RadixTreeCorrupted, PoolCorrupted)  # a tree alone knows no pool


_UNDER_O = f"""
import sys
if __debug__:
    sys.exit("not started with -O")
sys.path.insert(0, {str(TESTS)!r})
from test_invariants import BREAKAGES
for name, (breaker, error, message) in BREAKAGES.items():
    try:
        breaker()
    except error as raised:
        print(name, "raised" if message in str(raised) else f"raised without {{message!r}}")
    else:
        print(name, "did not raise")
"""


def test_the_checks_still_raise_under_python_dash_o() -> None:
    done = subprocess.run(
        [sys.executable, "-O", "-c", _UNDER_O],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{name} raised" for name in BREAKAGES]
