"""Hypothesis: random stores, lookups, fetches, evictions, resizes, policy changes and damaged
disk files against a real `KVStorage` with a `TieredStore` of a host tier and a disk tier.

Every page a chain stores holds contents derived from its partition and its tokens up to the
page's end (`contents`), so a fetch is checked against exactly the tokens and partition it was
asked for: contents survive store → host → disk demotion → load, slot moves of a shrink and a
policy change, and another partition's page (or a damaged file) can only show up as a mismatch.
After every step: the index invariants (`TieredStore.check`), every slot and file holding the
page its entry names, the host tier's slabs holding exactly its capacity, the directory holding
exactly the files of the disk index, and counters that add up. While every policy has been lru,
a prefix is never cut in the middle while its tail survives: every held page's parent is held
too (or was a damaged file).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections import Counter
from functools import cache
from pathlib import Path

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kv_device import DEVICE

from kvctl.agent.pool.storage import KVStorage
from kvctl.agent.prefix import EVICTION_POLICIES, IsolationKey
from kvctl.agent.prefix.prefix_cache import Spilled
from kvctl.agent.tiers import TieredStore
from kvctl.agent.tiers.disk_tier import SUFFIX, DiskSlots
from kvctl.agent.tiers.host_tier import HostSlots
from kvctl.agent.tiers.page_keys import page_digests, root_digest

PAGE = 2
LAYERS, HEADS, HEAD_DIM = 2, 1, 2
PAGE_SHAPE = (LAYERS, 2, PAGE, HEADS, HEAD_DIM)
SEGMENT = 8
DEVICE_PAGES = 2 * SEGMENT
SLAB_PAGES = 3  # host slabs of 3 pages: resizes cross slab boundaries
MAX_CHAIN_PAGES = 7

KEYS = [
    IsolationKey("m"),
    IsolationKey("m", "tenant"),
    IsolationKey("other"),
    IsolationKey("m", None, (0.0, 1.0, -1, None)),
]
BASES = [[1, 1, 2, 0, 1, 2, 2, 0, 1, 1], [1, 1, 2, 0, 2, 2], [2, 0, 0, 1, 1, 1, 1, 2, 0, 0, 2]]
chains = st.builds(
    lambda base, cut, suffix: (base[:cut] + suffix)[: MAX_CHAIN_PAGES * PAGE],
    st.sampled_from(BASES),
    st.integers(PAGE, 11),
    st.lists(st.integers(0, 2), min_size=0, max_size=8),
)
keys = st.sampled_from(KEYS)
sizes = st.sampled_from([0, 1, 2, 3, 4, 5, 7, 10])
DAMAGE = {"truncate": "truncated", "flip": "checksum", "swap": "checksum", "delete": "missing"}


@cache
def contents(key: IsolationKey, prefix: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What the page ending `prefix` holds in `key`'s partition (on the host)."""
    text = repr((key, prefix)).encode()
    seed = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(PAGE_SHAPE, generator=generator).to(dtype)


class TierMachine(RuleBasedStateMachine):
    dtype = torch.float32

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvctl-tiers-"))
        self.storage = KVStorage(2, SEGMENT, PAGE, LAYERS, HEADS, HEAD_DIM, self.dtype, DEVICE)
        self.store = TieredStore(self.storage, 0, self.dir / "pages", 0)
        self.host, self.disk = self.store.tier("host"), self.store.tier("disk")
        assert isinstance(self.host.slots, HostSlots) and isinstance(self.disk.slots, DiskSlots)
        self.host.slots.slab_pages = SLAB_PAGES  # empty yet: slabs of this size from now on
        self.store.resize("host", 4 * self.host.page_bytes)
        self.store.resize("disk", 5 * self.disk.page_bytes)
        self.expected: dict[bytes, torch.Tensor] = {}  # digest -> the page it names
        self.parent: dict[bytes, bytes | None] = {}  # digest -> the previous page's digest
        self.named: dict[bytes, tuple[IsolationKey, tuple[int, ...]]] = {}
        # disk digest -> (its entry, the load failure it must give) until the entry leaves
        self.damaged: dict[bytes, tuple[object, str]] = {}
        self.ever_damaged: set[bytes] = set()
        self.loaded: Counter[str] = Counter()  # pages loaded per tier, as the fetches said
        self.failures: Counter[str] = Counter()  # disk load failures the damage must give
        self.lru_only = True
        self.stored: list[tuple[IsolationKey, list[int]]] = []  # chains stored so far

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- helpers ----------------------------------------------------------------------------

    def digests(self, key: IsolationKey, tokens: list[int], pages: int) -> list[bytes]:
        """The chain's names, recorded with what each page must hold."""
        names = page_digests(root_digest(key, self.store.layout), tokens, PAGE, pages)
        for k, digest in enumerate(names):
            prefix = tuple(tokens[: (k + 1) * PAGE])
            known = self.named.setdefault(digest, (key, prefix))
            assert known == (key, prefix), "two pages share a name"
            self.expected.setdefault(digest, contents(key, prefix, self.dtype))
            self.parent.setdefault(digest, names[k - 1] if k else None)
        return names

    def spill(self, key: IsolationKey, tokens: list[int], first: int, device: list[int]) -> None:
        self.spill_many([Spilled(key, tokens, first, device)])

    def spill_many(self, runs: list[Spilled]) -> None:
        """What the prefix cache does on eviction: device pages hold their K/V, the store
        keeps them (one call per eviction), then the pool reuses the pages (garbage from then
        on)."""
        runs = [run for run in runs if run.pages]
        if not runs:
            return
        for key, tokens, first, device in runs:
            values = [
                contents(key, tuple(tokens[: (first + i + 1) * PAGE]), self.dtype)
                for i in range(len(device))
            ]
            self.storage.fill_pages(device, torch.stack(values).to(DEVICE))
        self.store.store_many(runs)
        for run in runs:
            self.storage.fill_pages(run.pages, float("nan"))

    def prompt(self, data: st.DataObject) -> tuple[IsolationKey, list[int]]:
        """A prompt to look up: mostly one stored before (in its own partition or another),
        its tokens cut or extended; sometimes a fresh one."""
        if not self.stored or data.draw(st.integers(0, 4)) == 0:
            return data.draw(keys), data.draw(chains)
        key, tokens = data.draw(st.sampled_from(self.stored))
        if data.draw(st.integers(0, 3)) == 0:
            key = data.draw(keys)
        cut = data.draw(st.integers(PAGE, len(tokens)))
        tail = data.draw(st.lists(st.integers(0, 2), max_size=4))
        return key, (tokens[:cut] + tail)[: MAX_CHAIN_PAGES * PAGE]

    def forget_dropped_damage(self) -> None:
        """A damaged file whose entry left the disk tier is gone (evicted, or written afresh
        by a later store): it no longer fails."""
        index = self.disk.index
        self.damaged = {d: (e, r) for d, (e, r) in self.damaged.items() if index.get(d) is e}

    def holder(self, digest: bytes):
        return next((t for t in self.store.tiers if digest in t.index), None)

    # ---- rules ------------------------------------------------------------------------------

    @rule(key=keys, tokens=chains, data=st.data())
    def store_chain(self, key: IsolationKey, tokens: list[int], data: st.DataObject) -> None:
        """Evicted pages of a whole prompt, stored in one call: right after it, the chain's
        first pages are all found, as many as the tiers together hold."""
        pages = len(tokens) // PAGE
        self.digests(key, tokens, pages)
        device = data.draw(st.permutations(range(DEVICE_PAGES)))[:pages]
        self.spill(key, tokens, 0, device)
        self.stored.append((key, tokens))
        room = sum(t.index.capacity for t in self.store.tiers)
        hit = self.store.lookup(key, tokens, 0, pages)
        found = hit.pages if hit else 0
        assert found >= min(pages, room), f"{found} of {pages} pages found, {room} slots"

    @rule(key=keys, tokens=chains, data=st.data())
    def store_tail_then_head(
        self, key: IsolationKey, tokens: list[int], data: st.DataObject
    ) -> None:
        """Leaf-first eviction: the last pages, then the ones before them, in two evictions or
        as two runs of one."""
        pages = len(tokens) // PAGE
        split = data.draw(st.integers(0, pages))
        self.digests(key, tokens, pages)
        device = data.draw(st.permutations(range(DEVICE_PAGES)))[:pages]
        tail, head = (
            Spilled(key, tokens, split, device[split:]),
            Spilled(key, tokens, 0, device[:split]),
        )
        if data.draw(st.booleans()):
            self.spill_many([tail])
            self.spill_many([head])
        else:
            self.spill_many([tail, head])
        self.stored.append((key, tokens))

    @rule(batch=st.lists(st.tuples(keys, chains), min_size=2, max_size=4), data=st.data())
    def store_several(self, batch: list[tuple[IsolationKey, list[int]]], data: st.DataObject):
        """One eviction that frees the pages of several prompts (distinct pool pages)."""
        free = data.draw(st.permutations(range(DEVICE_PAGES)))
        runs = []
        for key, tokens in batch:
            pages = min(len(tokens) // PAGE, len(free))
            if not pages:
                break
            self.digests(key, tokens, pages)
            runs.append(Spilled(key, tokens[: pages * PAGE], 0, free[:pages]))
            free = free[pages:]
            self.stored.append((key, tokens[: pages * PAGE]))
        self.spill_many(runs)

    @rule(data=st.data())
    def fetch(self, data: st.DataObject) -> None:
        """Look a prompt up from its start (nothing on the device) and load what is found."""
        key, tokens = self.prompt(data)
        pages = len(tokens) // PAGE
        self._fetch(key, tokens, 0, data.draw(st.integers(0, pages)))

    @rule(data=st.data())
    def fetch_after_device_match(self, data: st.DataObject) -> None:
        """Look up past a device match of `first` pages; the device evicts those pages later
        (they are stored then, as the prefix cache would)."""
        key, tokens = self.prompt(data)
        pages = len(tokens) // PAGE
        first = data.draw(st.integers(1, pages))
        self._fetch(key, tokens, first, data.draw(st.integers(first, pages)))
        self.digests(key, tokens, first)
        self.spill(key, tokens, 0, data.draw(st.permutations(range(DEVICE_PAGES)))[:first])

    def _fetch(self, key: IsolationKey, tokens: list[int], first: int, last: int) -> None:
        hit = self.store.lookup(key, tokens, first, last)
        names = page_digests(root_digest(key, self.store.layout), tokens, PAGE, last)
        if hit is None:
            assert first >= last or self.holder(names[first]) is None
            return
        assert hit.first_page == first and hit.digests == names[first : first + hit.pages]
        for digest in hit.digests:
            assert self.named[digest][0] == key, "a page of another partition matched"
        assert first + hit.pages == last or self.holder(names[first + hit.pages]) is None
        # what the fetch must give: pages up to the first damaged file it reads from disk
        self.forget_dropped_damage()
        plan: list[str] = []
        stop: str | None = None
        for digest in hit.digests:
            tier = self.holder(digest)
            assert tier is not None
            if tier is self.disk and digest in self.damaged:
                stop = self.damaged.pop(digest)[1]
                break
            plan.append(tier.name)
        load = self.store.fetch(hit)
        if stop is not None:
            self.failures[stop] += 1
            event(f"damaged page: {stop}")
        if not plan:
            assert load is None
            return
        assert load is not None and load.first_page == first and load.pages == len(plan)
        assert load.pages_by_tier == dict(Counter(plan))
        self.loaded.update(plan)
        event(f"fetched from {'+'.join(sorted(set(plan)))}")
        for i, digest in enumerate(hit.digests[: load.pages]):
            assert torch.equal(load.data[i].cpu(), self.expected[digest]), "wrong K/V loaded"

    @rule(tier=st.sampled_from(["host", "disk"]), pages=sizes, extra=st.floats(0, 0.99))
    def resize(self, tier: str, pages: int, extra: float) -> None:
        held = self.store.tier(tier)
        size = held.page_bytes
        old_pages = held.index.capacity
        old, new = self.store.resize(tier, pages * size + int(extra * size))
        assert (old, new) == (old_pages * size, pages * size)
        assert held.index.capacity == pages and len(held.index) <= pages

    @rule(tier=st.sampled_from(["host", "disk"]), policy=st.sampled_from(sorted(EVICTION_POLICIES)))
    def set_policy(self, tier: str, policy: str) -> None:
        self.store.set_policy(tier, policy)
        self.lru_only &= policy == "lru"

    @rule(kind=st.sampled_from(sorted(DAMAGE)), data=st.data())
    def damage(self, kind: str, data: st.DataObject) -> None:
        """Alter a page file behind the tier's back: its next load must be a miss."""
        self.forget_dropped_damage()
        sound = sorted(d for d in self.disk.index.entries if d not in self.damaged)
        if not sound:
            return
        digest = data.draw(st.sampled_from(sound))
        path = self.disk.slots.file_of(digest)
        blob = path.read_bytes()
        if kind == "truncate":
            path.write_bytes(blob[: data.draw(st.integers(0, len(blob) - 1))])
        elif kind == "flip":
            at = data.draw(st.integers(0, len(blob) - 1))
            bit = 1 << data.draw(st.integers(0, 7))
            path.write_bytes(blob[:at] + bytes([blob[at] ^ bit]) + blob[at + 1 :])
        elif kind == "swap":
            others = [d for d in sound if d != digest]
            if not others:
                return
            other = data.draw(st.sampled_from(others))
            shutil.copyfile(self.disk.slots.file_of(other), path)
        else:
            path.unlink()
        self.damaged[digest] = (self.disk.index.get(digest), DAMAGE[kind])
        self.ever_damaged.add(digest)
        event(f"damaged a file: {kind}")
        if data.draw(st.booleans()):  # the prompt of that page comes back at once
            key, prefix = self.named[digest]
            self._fetch(key, list(prefix), 0, len(prefix) // PAGE)

    # ---- invariants -------------------------------------------------------------------------

    @invariant()
    def indexes_are_sound(self) -> None:
        self.store.check()
        for tier in self.store.tiers:
            assert len(tier.index) <= tier.index.capacity

    @invariant()
    def host_slabs_hold_exactly_the_capacity(self) -> None:
        slots = self.host.slots
        assert isinstance(slots, HostSlots)
        rows = [slab.shape[0] for slab in slots._slabs]
        assert sum(rows) == slots.capacity >= self.host.index.capacity
        pass

    @invariant()
    def every_slot_holds_its_page(self) -> None:
        entries = list(self.host.index.entries.values())
        if entries:
            data = self.host.slots.read([e.slot for e in entries], torch.device("cpu"))
            for entry, page in zip(entries, data, strict=True):
                assert torch.equal(page, self.expected[entry.digest]), "a host slot changed"

    @invariant()
    def the_directory_holds_exactly_the_disk_index(self) -> None:
        disk = self.disk.slots
        assert isinstance(disk, DiskSlots)
        self.store.flush()  # files are written in the background
        files = {p.name for p in disk.path.iterdir()}
        self.forget_dropped_damage()
        deleted = {d for d, (_, reason) in self.damaged.items() if reason == "missing"}
        expected = {disk.file_of(d).name for d in self.disk.index.entries if d not in deleted}
        assert files == expected, f"leaked {files - expected}, missing {expected - files}"
        assert all(name.endswith(SUFFIX) for name in files)
        for digest in self.disk.index.entries:
            if digest not in self.damaged:
                assert torch.equal(disk.read(digest), self.expected[digest]), "a file changed"

    @invariant()
    def counters_add_up(self) -> None:
        for stats in self.store.stats():
            tier = self.store.tier(stats.name)
            c = stats.counters
            assert stats.capacity_pages == tier.index.capacity
            assert stats.used_pages == len(tier.index)
            assert c.hits_tokens == c.loaded_pages * PAGE
            assert c.loaded_pages == self.loaded[stats.name]
            assert c.loaded_bytes == c.loaded_pages * tier.slots.page_bytes
            assert c.stored_bytes == c.stored_pages * tier.slots.page_bytes
            assert c.store_failures["io"] == 0
            assert c.stored_pages >= len(tier.index)
        assert +self.disk.counters.load_failures == +self.failures
        assert +self.host.counters.load_failures == Counter()

    @invariant()
    def a_prefix_is_never_cut_while_its_tail_survives(self) -> None:
        if not self.lru_only:
            return
        for tier in self.store.tiers:
            for digest in tier.index.entries:
                parent = self.parent[digest]
                if parent is None or parent in self.ever_damaged:
                    continue
                assert self.holder(parent) is not None, f"{tier.name}: a page's parent is gone"


class TierMachineBfloat16(TierMachine):
    """The same with 2-byte elements (disk files are raw bytes; numpy has no bfloat16)."""

    dtype = torch.bfloat16


TierMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TierMachineBfloat16.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestTierMachine = TierMachine.TestCase
TestTierMachineBfloat16 = TierMachineBfloat16.TestCase
