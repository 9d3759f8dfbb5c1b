"""`TieredStore` on its own, case by case: which pages a store keeps where, in which order the
tiers drop them, how much memory the host tier takes, and what a failed disk write leaves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kv_device import DEVICE

from kvctl.agent.pool.storage import KVStorage
from kvctl.agent.prefix import IsolationKey
from kvctl.agent.prefix.prefix_cache import Spilled
from kvctl.agent.tiers import TieredStore
from kvctl.agent.tiers import disk_tier as disk_module
from kvctl.agent.tiers.host_tier import HostSlots

PAGE = 2
KEY = IsolationKey("m")


@pytest.fixture
def storage() -> KVStorage:
    return KVStorage(2, 8, PAGE, 2, 1, 2, torch.float32, DEVICE)


def make_store(storage: KVStorage, host: int, disk: int = 0, path: Path | None = None, **kw):
    """A store with room for `host` pages in memory and `disk` page files under `path`."""
    page = storage.bytes_per_page
    store = TieredStore(storage, host * page, path, 0, **kw)
    if path is not None:
        store.resize("disk", disk * store.tier("disk").page_bytes)
    return store


def chain(first: int, pages: int) -> list[int]:
    """Tokens of a prompt of `pages` whole pages, distinct for each `first`."""
    return [first * 100 + i for i in range(pages * PAGE)]


def spill(store: TieredStore, tokens: list[int], first_page: int = 0) -> None:
    """Store pages `first_page, ...` of `tokens`, as the prefix cache evicts them."""
    pages = len(tokens) // PAGE - first_page
    device = list(range(pages))
    store.storage.fill_pages(device, float(tokens[0]))
    store.store(KEY, tokens, first_page, device)


def spill_many(store: TieredStore, prompts: list[list[int]]) -> None:
    """One eviction freeing the whole pages of several prompts (distinct pool pages)."""
    runs, free = [], 0
    for tokens in prompts:
        pages = list(range(free, free + len(tokens) // PAGE))
        free += len(pages)
        store.storage.fill_pages(pages, float(tokens[0]))
        runs.append(Spilled(KEY, tokens, 0, pages))
    store.store_many(runs)


def found(store: TieredStore, tokens: list[int]) -> int:
    hit = store.lookup(KEY, tokens, 0, len(tokens) // PAGE)
    return hit.pages if hit else 0


def test_a_prompt_longer_than_the_host_tier_goes_on_to_disk(storage, tmp_path):
    """The host tier keeps the first pages it has room for and hands the rest down: the disk
    tier below has room, so nothing is dropped as `full`."""
    store = make_store(storage, host=2, disk=10, path=tmp_path)
    tokens = chain(1, 5)
    spill(store, tokens)
    assert found(store, tokens) == 5
    host, disk = store.tier("host"), store.tier("disk")
    assert len(host.index) == 2 and len(disk.index) == 3
    assert host.counters.store_failures["full"] == disk.counters.store_failures["full"] == 0
    load = store.fetch(store.lookup(KEY, tokens, 0, 5))
    assert load is not None and load.pages_by_tier == {"host": 2, "disk": 3}
    assert torch.equal(load.data.cpu(), torch.full_like(load.data.cpu(), float(tokens[0])))


def test_the_last_tier_keeps_a_long_prompts_first_pages(storage):
    store = make_store(storage, host=3)
    tokens = chain(1, 5)
    spill(store, tokens)
    assert found(store, tokens) == 3
    assert store.tier("host").counters.store_failures["full"] == 2


def test_pages_demoted_to_disk_keep_their_order(storage, tmp_path):
    """A prompt's pages go from the host tier to disk deepest first; on disk they must still
    go deepest first, so that the disk tier drops the tail of a prefix, never its head."""
    store = make_store(storage, host=4, disk=4, path=tmp_path)
    first, second, third = chain(1, 4), chain(2, 4), chain(3, 2)
    spill(store, first)
    spill(store, second)  # the first prompt's pages go down to disk
    assert len(store.tier("disk").index) == 4
    spill(store, third)  # two of the second's go down: the disk drops two of the first's
    assert found(store, first) == 2
    assert found(store, second) == 4 and found(store, third) == 2


def test_a_prompt_stored_again_with_more_pages_keeps_its_head_longest(storage):
    """Pages a tier already holds and new pages of the same prompt are ordered together: the
    new, deeper pages go first when the tier needs room."""
    store = make_store(storage, host=4)
    short, long = chain(1, 2), chain(1, 4)
    spill(store, short)
    spill(store, long)  # its first two pages are held already
    spill(store, chain(2, 2))
    assert found(store, long) == 2


def test_storing_a_prompt_never_evicts_its_own_pages(storage):
    """lfu: the pages of other prompts served more often stay, but a prompt's own pages are
    not what makes room for the rest of it (its head would go, leaving its tail unreachable)."""
    store = make_store(storage, host=3, host_policy="lfu")
    for n in (2, 3):
        spill(store, chain(n, 1))
        for _ in range(2):
            assert store.fetch(store.lookup(KEY, chain(n, 1), 0, 1)) is not None
    spill(store, chain(1, 1))
    spill(store, chain(1, 2))  # needs one page: not the first page of this very prompt
    assert found(store, chain(1, 2)) == 2


def test_a_page_an_earlier_run_moved_down_is_stored_with_its_own_run(storage, tmp_path):
    """One eviction, two runs: the first pushes the host tier's pages down to disk, among them
    the first page of the second run's prompt, held in host memory when the eviction began.
    The second run stores that page again (the pool still holds it), so the disk tier making
    room for the first run's pages cannot leave the second prompt without its head."""
    store = make_store(storage, host=4, disk=5, path=tmp_path)
    spill_many(store, [chain(1, 1), chain(2, 3)])
    spill_many(store, [chain(3, 5), chain(1, 2)])
    assert found(store, chain(1, 2)) == 2
    assert found(store, chain(3, 5)) == 5
    load = store.fetch(store.lookup(KEY, chain(1, 2), 0, 2))
    assert load is not None and torch.all(load.data.cpu() == 100.0)


def test_the_host_tier_takes_exactly_its_size(storage):
    """A tier of 3 pages allocates 3 pages, not a whole slab; it grows and shrinks to exactly
    its size and keeps what it holds."""
    store = make_store(storage, host=3)
    host = store.tier("host")
    slots = host.slots
    assert isinstance(slots, HostSlots)

    def allocated() -> int:
        return sum(slab.numel() * slab.element_size() for slab in slots._slabs)

    assert slots.capacity == 3 and allocated() == 3 * slots.page_bytes
    tokens = chain(1, 3)
    spill(store, tokens)
    kept = 3
    for pages in (5, 2, 0, 4):
        store.resize("host", pages * slots.page_bytes)
        assert slots.capacity == host.index.capacity == pages
        assert allocated() == pages * slots.page_bytes
        kept = min(kept, pages)  # a shrink drops the deepest pages (no disk tier)
        assert found(store, tokens) == kept
        if kept:
            load = store.fetch(store.lookup(KEY, tokens, 0, 3))
            assert load is not None and torch.all(load.data.cpu() == float(tokens[0]))


def test_slabs_in_whole_pages_and_a_last_smaller_one():
    slots = HostSlots(0, (1, 2, 2, 1, 2), torch.float32, torch.device("cpu"))
    slots.slab_pages = 3
    for pages in (7, 9, 4, 10, 0, 2):
        slots.resize(pages)
        rows = [int(s.shape[0]) for s in slots._slabs]
        assert sum(rows) == slots.capacity == pages
        assert all(r == 3 for r in rows[:-1]) and all(0 < r <= 3 for r in rows)
    slots.resize(5)
    data = torch.arange(5 * 8, dtype=torch.float32).reshape(5, 1, 2, 2, 1, 2)
    slots.write([0, 1, 2, 3, 4], data)
    slots.resize(7)  # the last slab grows: what it held is copied
    assert torch.equal(slots.read([0, 1, 2, 3, 4], torch.device("cpu")), data)
    slots.resize(4)
    assert torch.equal(slots.read([0, 1, 2, 3], torch.device("cpu")), data[:4])


def test_a_failed_disk_write_leaves_no_file(storage, tmp_path, monkeypatch):
    """A page whose file cannot be put in place is counted as an io failure, is not in the
    index, and leaves nothing in the directory (no temporary file either)."""
    store = make_store(storage, host=0, disk=4, path=tmp_path)

    def refuse(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_module.os, "replace", refuse)
    spill(store, chain(1, 2))
    store.flush()
    disk = store.tier("disk")
    assert disk.counters.store_failures["io"] == 2 and len(disk.index) == 0
    assert list(tmp_path.iterdir()) == []
    store.check()
