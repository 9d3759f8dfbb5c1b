"""The tiers below the device pool, host memory then disk, as one store for the prefix cache.

Pages the prefix cache evicts from the device are *stored* into the first tier instead of being
dropped; a tier that needs room evicts by its own policy and hands its victims to the tier below
(host → disk), and the last tier drops them. A prompt's pages keep their order all the way down
(the deepest goes first, in the tier below too), the pages being stored are never what makes
room for themselves, and a prompt longer than a tier leaves its first pages there and hands the
rest down, so a prefix loses its tail, not its head.

At admission a prompt is *looked up* past what the device matched, page by page through every
tier (`lookup`, the index only), and once the request has its pages the hit is *fetched*: host
slots and verified disk files are copied into a device tensor that the engine writes into the
request's pages before the step's forward (`fetch`). A page that fails its check cuts the hit
there and is computed like any other.

Tiers are inclusive: a loaded page stays in its tier, so evicting it from the device again costs
a touch, not a copy. Every hit is attributed to the one tier its pages came from; counters,
sizes and timings are kept per tier for the metrics (`stats`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from kvctl.agent.pool.storage import KVStorage
from kvctl.agent.prefix import IsolationKey
from kvctl.agent.prefix.eviction import make_policy
from kvctl.agent.prefix.prefix_cache import Spilled
from kvctl.agent.tiers.disk_tier import LOAD_FAILURES, DiskPageError, DiskSlots
from kvctl.agent.tiers.host_tier import HostSlots, available_memory
from kvctl.agent.tiers.page_keys import layout_of, page_digests, root_digest
from kvctl.agent.tiers.tier_index import TierCorrupted, TierEntry, TierIndex
from kvctl.units import format_bytes

TIER_NAMES = ("host", "disk")
STORE_FAILURES = ("full", "io")


@dataclass
class TierCounters:
    """What one tier did since start."""

    hits_tokens: int = 0
    stored_pages: int = 0
    stored_bytes: int = 0
    loaded_pages: int = 0
    loaded_bytes: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    evicted_pages: int = 0
    store_failures: Counter[str] = field(
        default_factory=lambda: Counter(dict.fromkeys(STORE_FAILURES, 0))
    )
    load_failures: Counter[str] = field(
        default_factory=lambda: Counter(dict.fromkeys(LOAD_FAILURES, 0))
    )


@dataclass(frozen=True)
class TierStats:
    """One tier read at one moment: its size and its counters."""

    name: str
    policy: str
    capacity_pages: int
    used_pages: int
    page_bytes: int  # bytes a page takes in this tier (a disk page's file, header included)
    counters: TierCounters
    path: str | None = None
    filesystem: tuple[int, int] | None = None  # disk: (free, size) bytes of its filesystem

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes


@dataclass
class _Tier:
    slots: HostSlots | DiskSlots
    index: TierIndex
    counters: TierCounters = field(default_factory=TierCounters)

    @property
    def name(self) -> str:
        return self.slots.name

    @property
    def page_bytes(self) -> int:
        slots = self.slots
        return slots.file_bytes if isinstance(slots, DiskSlots) else slots.page_bytes


@dataclass(frozen=True)
class TierHit:
    """Whole pages of a prompt found below the device: `digests[i]` is page `first_page + i`."""

    first_page: int
    digests: list[bytes]

    @property
    def pages(self) -> int:
        return len(self.digests)


@dataclass(frozen=True)
class TierLoad:
    """A fetched hit: `data[i]` is the K/V of page `first_page + i`, on the pool's device."""

    first_page: int
    data: Tensor
    pages_by_tier: dict[str, int]

    @property
    def pages(self) -> int:
        return int(self.data.shape[0])


class TieredStore:
    """Host and disk tiers under one pool's storage (either may be absent, not both)."""

    def __init__(
        self,
        storage: KVStorage,
        host_bytes: int = 0,
        disk_path: Path | str | None = None,
        disk_bytes: int = 0,
        host_policy: str = "lru",
        disk_policy: str = "lru",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if host_bytes < 0 or disk_bytes < 0:
            raise ValueError("tier sizes must be 0 or more bytes")
        self.storage = storage
        self.page_size = storage.page_size
        shape = (storage.num_layers, 2, storage.page_size, storage.num_kv_heads, storage.head_dim)
        self.layout = layout_of(
            storage.num_layers,
            storage.num_kv_heads,
            storage.head_dim,
            str(storage.dtype).removeprefix("torch."),
            storage.page_size,
        )
        self.clock = clock
        self._roots: dict[IsolationKey, bytes] = {}
        host = HostSlots(0, shape, storage.dtype, storage.device)
        self._host_slots = host  # the first tier's slots, typed: only host memory reads into
        check_host_memory(host_bytes // host.page_bytes * host.page_bytes)
        self.tiers: list[_Tier] = [_Tier(host, TierIndex(0, make_policy(host_policy)))]
        self._resize_tier(self.tiers[0], host_bytes // host.page_bytes)
        if disk_path is not None:
            disk = DiskSlots(Path(disk_path), shape, storage.dtype)
            pages = disk_bytes // disk.file_bytes
            self.tiers.append(_Tier(disk, TierIndex(pages, make_policy(disk_policy))))

    # ---- reading --------------------------------------------------------------------------

    def tier(self, name: str) -> _Tier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        configured = ", ".join(t.name for t in self.tiers)
        raise ValueError(f"no {name} tier on this agent (tiers: {configured})")

    def stats(self) -> list[TierStats]:
        self._reap()
        out = []
        for tier in self.tiers:
            disk = tier.slots if isinstance(tier.slots, DiskSlots) else None
            out.append(
                TierStats(
                    tier.name,
                    tier.index.policy.name,
                    tier.index.capacity,
                    len(tier.index),
                    tier.page_bytes,
                    _copy(tier.counters),
                    str(disk.path) if disk else None,
                    disk.filesystem() if disk else None,
                )
            )
        return out

    def flush(self) -> None:
        """Wait for the disk tier's queued writes, and account for those that failed."""
        for tier in self.tiers:
            if isinstance(tier.slots, DiskSlots):
                tier.slots.flush()
        self._reap()

    def _reap(self) -> None:
        """Forget disk pages whose background write failed, counted as `io` store failures
        (they never became readable, so nothing may find them)."""
        for tier in self.tiers:
            if not isinstance(tier.slots, DiskSlots):
                continue
            for digest in tier.slots.take_failures():
                entry = tier.index.get(digest)
                if entry is not None:
                    tier.index.remove(entry)
                tier.counters.store_failures["io"] += 1

    def problems(self) -> list[str]:
        """Problems of every tier's index (empty when none)."""
        return [f"{t.name}: {p}" for t in self.tiers for p in t.index.problems()]

    def check(self) -> None:
        """Raise `TierCorrupted` naming every tier's problems, if there is any."""
        found = self.problems()
        if found:
            raise TierCorrupted("; ".join(found))

    # ---- storing (device evictions) -------------------------------------------------------

    def store(
        self, key: IsolationKey, tokens: Sequence[int], first_page: int, pages: Sequence[int]
    ) -> None:
        """Keep device pages `pages` (pages `first_page, ...` of `tokens`, whose first tokens
        are the prefix up to them) in the tiers: call it before the pool reuses them."""
        self.store_many([Spilled(key, list(tokens), first_page, list(pages))])

    def store_many(self, spilled: Sequence[Spilled]) -> None:
        """Keep the pages of one eviction (`PrefixCache.spill`), each run in the order given
        (the first evicted first, so the oldest in its tier). The pages a tier may need are
        read from the pool in one gather; pages the top tier held then, and an earlier run
        moved down meanwhile, are read before their own run (the pool still holds them)."""
        self._reap()
        top = next((t for t in self.tiers if t.index.capacity), None)
        if top is None:
            return
        runs = [
            (
                page_digests(self._root(key), tokens, self.page_size, first + len(pages))[first:],
                pages,
            )
            for key, tokens, first, pages in spilled
            if pages
        ]
        if not runs:
            return
        started = self.clock()
        rows: dict[bytes, int] = {}
        origins = {
            digest: self._root(run.key)
            for run, (digests, _) in zip((r for r in spilled if r.pages), runs, strict=True)
            for digest in digests
        }
        wanted: list[int] = []
        for digests, pages in runs:
            self._wanted(top, digests, pages, rows, wanted)
        data = self.storage.read_pages(wanted) if wanted else None
        for digests, pages in runs:
            known = len(wanted)
            self._wanted(top, digests, pages, rows, wanted)
            if len(wanted) > known:
                more = self.storage.read_pages(wanted[known:])
                data = more if data is None else torch.cat([data, more])
            self._put(0, digests, data, rows, origins, started)
            started = self.clock()

    @staticmethod
    def _wanted(
        top: _Tier,
        digests: list[bytes],
        pages: Sequence[int],
        rows: dict[bytes, int],
        wanted: list[int],
    ) -> None:
        """Add the pool pages whose contents storing a run may need: those the top tier does
        not hold, and those past its capacity (they go on down)."""
        for position, (digest, page) in enumerate(zip(digests, pages, strict=True)):
            if digest not in rows and (digest not in top.index or position >= top.index.capacity):
                rows[digest] = len(wanted)
                wanted.append(page)

    def _put(
        self,
        level: int,
        digests: list[bytes],
        data: Tensor | None,
        rows: dict[bytes, int],
        origins: dict[bytes, bytes],
        started: float,
    ) -> None:
        """Store pages into tier `level`, the first the most wanted (a chain's pages from the
        shallowest; victims of the tier above from the last to go). `data[rows[d]]` is the page
        of a digest the tier may not hold. A tier with no capacity passes them down; one with
        less capacity than pages keeps the first and passes the rest down, and the last tier
        drops what does not fit (counted as `full`). The tier's other pages make room, never
        the ones stored; the pages end up touched in the order given, the first the newest."""
        if level >= len(self.tiers):
            return
        tier = self.tiers[level]
        index = tier.index
        if not index.capacity:
            self._put(level + 1, digests, data, rows, origins, started)
            return
        kept, over = digests[: index.capacity], digests[index.capacity :]
        held = [e for e in map(index.get, kept) if e is not None]
        fresh = [d for d in kept if d not in index]
        if len(fresh) > index.free_slots:
            self._evict(level, index.victims(len(fresh) - index.free_slots, spare=held))
        if fresh:
            assert data is not None
            entries = index.add(fresh)
            for entry in entries:
                entry.root = origins.get(entry.digest, b"")
            picked = data[[rows[d] for d in fresh]]
            if isinstance(tier.slots, DiskSlots):
                written = tier.slots.write(fresh, picked)
                for entry, ok in zip(entries, written, strict=True):
                    if not ok:
                        index.remove(entry)
                failed = written.count(False)
                tier.counters.store_failures["io"] += failed
                stored = len(entries) - failed
            else:
                tier.slots.write([e.slot for e in entries], picked)
                stored = len(entries)
            counters = tier.counters
            counters.stored_pages += stored
            counters.stored_bytes += stored * tier.slots.page_bytes
            counters.store_seconds += self.clock() - started
        index.touch([index.entries[d] for d in kept if d in index], hit=False)
        down = [d for d in over if d not in index and d in rows]
        if not down:
            return
        if any(t.index.capacity for t in self.tiers[level + 1 :]):
            self._put(level + 1, down, data, rows, origins, self.clock())
        else:
            tier.counters.store_failures["full"] += len(down)

    def _evict(self, level: int, victims: list[TierEntry]) -> None:
        """Pages leaving tier `level`: handed down to the next tier, or dropped."""
        if not victims:
            return
        tier = self.tiers[level]
        tier.counters.evicted_pages += len(victims)
        if isinstance(tier.slots, DiskSlots):
            tier.slots.remove([v.digest for v in victims])
            return
        if any(t.index.capacity for t in self.tiers[level + 1 :]):
            started = self.clock()
            order = victims[::-1]  # the last to go first: the order they had here is kept below
            data = tier.slots.read([v.slot for v in order], torch.device("cpu"))
            digests = [v.digest for v in order]
            rows = {d: i for i, d in enumerate(digests)}
            self._put(level + 1, digests, data, rows, {v.digest: v.root for v in order}, started)

    # ---- finding and loading --------------------------------------------------------------

    def lookup(
        self, key: IsolationKey, tokens: Sequence[int], first_page: int, last_page: int
    ) -> TierHit | None:
        """Pages `first_page, ...` (below `last_page`) of `tokens` that some tier holds, up to
        the first page none does; None when not even `first_page` is held. Reads the index
        only."""
        if first_page >= last_page or not any(len(t.index) for t in self.tiers):
            return None
        digests = page_digests(self._root(key), tokens, self.page_size, last_page)
        found = []
        for digest in digests[first_page:]:
            if not any(digest in t.index for t in self.tiers):
                break
            found.append(digest)
        return TierHit(first_page, found) if found else None

    def prefix_pages(
        self, key: IsolationKey, tokens: Sequence[int], last_page: int
    ) -> dict[str, int]:
        """How many whole pages from the first of `tokens` (below `last_page`) each tier holds
        in a row, by tier name (a lookup's answer; reads the index only)."""
        digests = page_digests(self._root(key), tokens, self.page_size, last_page)
        held = {}
        for tier in self.tiers:
            count = 0
            while count < len(digests) and digests[count] in tier.index:
                count += 1
            held[tier.name] = count
        return held

    def knows_salt(self, salt: str) -> bool:
        """Whether a tier holds a page of a partition of cache salt `salt`."""
        roots = {root for key, root in self._roots.items() if key.salt == salt}
        return bool(roots) and any(
            e.root in roots for tier in self.tiers for e in tier.index.entries.values()
        )

    def drop(self, salts: Collection[str | None] | None, names: Collection[str]) -> dict[str, int]:
        """Forget the pages of the partitions of cache salts `salts` (every page when None) in
        the tiers named; how many pages each tier let go (a purge: nothing moves down)."""
        roots = (
            None
            if salts is None
            else {root for key, root in self._roots.items() if key.salt in salts}
        )
        dropped = {}
        for tier in self.tiers:
            if tier.name not in names:
                continue
            index = tier.index
            victims = [e for e in index.entries.values() if roots is None or e.root in roots]
            for entry in victims:
                index.remove(entry)
            if isinstance(tier.slots, DiskSlots) and victims:
                tier.slots.remove([e.digest for e in victims])
            dropped[tier.name] = len(victims)
        return dropped

    def fetch(self, hit: TierHit, count_tokens: bool = True) -> TierLoad | None:
        """The hit's pages as one device tensor, up to the first page that is gone or fails
        its check (None when that is the first). Counts each page's tokens to its tier, unless
        `count_tokens` is False (another page group's pages of tokens already counted)."""
        self._reap()
        device = self.storage.device
        plan: list[tuple[_Tier, TierEntry]] = []
        for digest in hit.digests:
            held = next(
                ((t, t.index.entries[digest]) for t in self.tiers if digest in t.index), None
            )
            if held is None:
                break
            plan.append(held)
        disk_pages: dict[int, Tensor] = {}
        for position, (tier, entry) in enumerate(plan):
            if not isinstance(tier.slots, DiskSlots):
                continue
            started = self.clock()
            try:
                disk_pages[position] = tier.slots.read(entry.digest)
            except DiskPageError as e:
                tier.counters.load_failures[e.reason] += 1
                tier.index.remove(entry)
                tier.slots.remove([entry.digest])
                del plan[position:]
                break
            finally:
                tier.counters.load_seconds += self.clock() - started
        if not plan:
            return None
        out = torch.empty(
            (len(plan), *self.tiers[0].slots.page_shape), dtype=self.storage.dtype, device=device
        )
        by_tier: Counter[str] = Counter()
        host_rows = [i for i, (t, _) in enumerate(plan) if i not in disk_pages]
        if host_rows:
            host = self.tiers[0]
            started = self.clock()
            self._host_slots.read_into(out, host_rows, [plan[i][1].slot for i in host_rows])
            if out.device.type == "cuda":  # the copies run async: time them, not their launch
                torch.cuda.current_stream(out.device).synchronize()
            host.counters.load_seconds += self.clock() - started
        for position, page in disk_pages.items():
            out[position].copy_(page)
        for tier in self.tiers:
            entries = [e for t, e in plan if t is tier]
            if entries:
                self._count_load(tier, entries, count_tokens)
                by_tier[tier.name] = len(entries)
        return TierLoad(hit.first_page, out, dict(by_tier))

    def _count_load(self, tier: _Tier, entries: list[TierEntry], count_tokens: bool) -> None:
        tier.index.touch(entries)
        counters = tier.counters
        counters.loaded_pages += len(entries)
        counters.loaded_bytes += len(entries) * tier.slots.page_bytes
        if count_tokens:
            counters.hits_tokens += len(entries) * self.page_size

    # ---- changing -------------------------------------------------------------------------

    def resize(self, name: str, capacity_bytes: int) -> tuple[int, int]:
        """Give tier `name` room for `capacity_bytes` (pages evicted to fit go down a tier);
        returns the old and new capacity in bytes."""
        if capacity_bytes < 0:
            raise ValueError("a tier's size must be 0 or more bytes")
        tier = self.tier(name)
        old = tier.index.capacity * tier.page_bytes
        if isinstance(tier.slots, HostSlots):
            check_host_memory(capacity_bytes - old)
        self._resize_tier(tier, capacity_bytes // tier.page_bytes)
        return old, tier.index.capacity * tier.page_bytes

    def _resize_tier(self, tier: _Tier, pages: int) -> None:
        level = self.tiers.index(tier)
        evicted, moves = tier.index.resize(pages)
        self._evict(level, evicted)
        if isinstance(tier.slots, HostSlots):
            if pages > tier.slots.capacity:
                tier.slots.resize(pages)
            tier.slots.move([(old, entry.slot) for entry, old in moves])
            tier.slots.resize(pages)

    def set_policy(self, name: str, policy: str) -> None:
        self.tier(name).index.set_policy(policy)

    def _root(self, key: IsolationKey) -> bytes:
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = root_digest(key, self.layout)
        return root


def _copy(counters: TierCounters) -> TierCounters:
    return replace(
        counters,
        store_failures=Counter(counters.store_failures),
        load_failures=Counter(counters.load_failures),
    )


def check_host_memory(more_bytes: int) -> None:
    """Refuse to take `more_bytes` of host memory the host does not have available: a host
    tier that pushes the node into swap or the OOM killer costs more than any prefill."""
    available = available_memory()
    if more_bytes > 0 and available is not None and more_bytes > available:
        raise ValueError(
            f"the host tier would take {format_bytes(more_bytes)} more and the host has "
            f"{format_bytes(available)} available; give a smaller size"
        )
