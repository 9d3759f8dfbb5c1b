"""Random operations on two or three pools of different page sizes under one KV budget, with real
page contents and the rebalancer moving memory between them.

Each pool has its own `KVStorage` shape (layers, heads, page size: a different page size in
bytes) and its own segment size. Every token written gets a distinct float64 tag in every layer
(K and V), so after every step each sequence must read back exactly its tags through its
(possibly moved) page table, pages the fake prefix cache holds must keep their contents, and
each pool's leak check must hold, whoever resized it: an operator (grow, shrink), the evictor
under an allocation, or the rebalancer. The budget holds at every step, and a rebalance is held
to a model of its rules: only pools pressured for `pressure_s` take, only pools calm for
`calm_s` give, neither turns round within `cooldown_s`, pinned pools keep their size, and a donor
keeps its floor, its promised pages and its used pages plus headroom; except that a pool below
its share, pressured for `reclaim_s`, takes back from pools above theirs whatever their state,
never below their share, floor, promise or pages in use. No pool takes and gives at one check.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)
from kv_device import DEVICE

from kvctl.agent.budget import KvBudget, Pressure, Rebalancer
from kvctl.agent.pool import (
    Defragmenter,
    PagePool,
    PageState,
    PoolExhausted,
    PoolResizer,
    ResizeRefused,
)
from kvctl.agent.pool.storage import KVStorage
from kvctl.settings import RebalanceSettings

# name: page_size, layers, kv_heads, head_dim, segment_pages (pages of 64, 128 and 192 bytes)
SHAPES = {"a": (4, 1, 1, 1, 4), "b": (4, 2, 1, 1, 3), "c": (2, 1, 3, 2, 5)}
CEILING_SEGMENTS = 8
NO_PRESSURE = Pressure()
pressures = st.one_of(
    st.just(NO_PRESSURE),
    st.builds(Pressure, st.integers(0, 12), st.integers(0, 1), st.integers(0, 1)),
)


@dataclass
class Member:
    """One model's pool, as the agent wires it, and what the test knows of it."""

    name: str
    pool: PagePool
    storage: KVStorage
    resizer: PoolResizer
    tags: dict[int, list[float]] = field(default_factory=dict)  # sequence -> token tags
    held: dict[int, torch.Tensor] = field(default_factory=dict)  # page -> contents when held
    promised: int = 0
    # the model of the rebalancer's rules
    pressured_since: float | None = None
    calm_since: float | None = 0.0
    took_at: float = float("-inf")
    gave_at: float = float("-inf")
    bytes_in: int = 0
    bytes_out: int = 0

    @property
    def segment(self) -> int:
        return self.pool.segment_pages

    @property
    def page_bytes(self) -> int:
        return self.pool.bytes_per_page

    def evict(self, pages: int, reason: str = "allocation") -> int:
        """The prefix cache's evictor: frees pages only it holds, lowest first."""
        victims = [p for p in sorted(self.held) if self.pool.pages.state(p) is PageState.CACHED]
        victims = victims[:pages]
        if victims:
            self.pool.holds.release(victims)
        for page in victims:
            del self.held[page]
        return len(victims)

    def follow(self, moves: dict[int, int]) -> None:
        self.held = {moves.get(p, p): contents for p, contents in self.held.items()}

    def snapshot(self) -> tuple:
        """What a refused call must leave as it was (see the pool machine: not the free extents,
        which a refused call may refill from released growth reservations)."""
        return (
            self.pool.capacity,
            self.pool.pages.map(),
            {s: list(self.pool.table(s).pages) for s in self.tags},
            self.storage.num_pages,
        )


class BudgetMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")

    @initialize(
        target=sequences,
        data=st.data(),
        count=st.integers(2, 3),
        batch=st.integers(1, 4),
        rebalance=st.builds(
            RebalanceSettings,
            enabled=st.sampled_from([True, True, True, False]),
            pressure_s=st.sampled_from([0.0, 1.0, 2.0]),
            calm_s=st.sampled_from([0.0, 1.0, 3.0]),
            cooldown_s=st.sampled_from([0.0, 2.0, 5.0]),
            headroom_ratio=st.sampled_from([0.0, 0.25, 1.0]),
            reclaim_s=st.sampled_from([0.0, 2.0, 5.0]),
        ),
    )
    def start(self, data: st.DataObject, count: int, batch: int, rebalance: RebalanceSettings):
        self.members: dict[str, Member] = {}
        self.now = 0.0
        self.settings = rebalance
        for name in list(SHAPES)[:count]:
            page_size, layers, heads, dim, segment = SHAPES[name]
            floor = data.draw(st.integers(1, 2), label=f"{name} floor segments")
            segments = data.draw(st.integers(floor, 4), label=f"{name} segments")
            storage = KVStorage(
                segments, segment, page_size, layers, heads, dim, torch.float64, device=DEVICE
            )
            pool = PagePool(
                segments * segment, page_size, segment, storage.bytes_per_page, reserve_pages=2
            )
            resizer = PoolResizer(
                pool,
                Defragmenter(pool, storage, batch_pages=batch),
                storage,
                min_pages=floor * segment,
                max_pages=CEILING_SEGMENTS * segment,
                promised=lambda name=name: self.members[name].promised,
            )
            member = Member(name, pool, storage, resizer)
            pool.set_evictor(member.evict)
            pool.relocation.add_listener(member.follow)
            self.members[name] = member
        held = sum(m.pool.capacity * m.page_bytes for m in self.members.values())
        most = sum(CEILING_SEGMENTS * m.segment * m.page_bytes for m in self.members.values())
        self.budget = KvBudget(held + data.draw(st.integers(0, most - held), label="unassigned"))
        for name, member in self.members.items():
            assert self.budget.add(name, member.resizer).resizer is member.resizer
        self.rebalancer = Rebalancer(self.budget, rebalance, lambda: self.now)
        self.ids = itertools.count()
        self.next_tag = itertools.count(1)
        return multiple(*self._warm_up(data))

    def _warm_up(self, data: st.DataObject) -> list[tuple[str, int]]:
        """Requests in every pool, some of them finished: live pages sit above free ones, so
        a donor's first shrink already has pages to move down."""
        refs = []
        for name, member in self.members.items():
            for tokens in data.draw(st.lists(st.integers(1, 12), max_size=4), label=name):
                if member.pool.can_allocate(tokens):
                    seq = next(self.ids)
                    member.pool.allocate(seq, tokens)
                    member.tags[seq] = []
                    self._write(member, seq, 0, tokens)
                    refs.append((name, seq))
            for seq in data.draw(st.sets(st.sampled_from(sorted(member.tags) or [-1]))):
                if seq in member.tags:
                    member.pool.free(seq)
                    del member.tags[seq]
        return refs

    # ---- contents -----------------------------------------------------------------------

    def _write(self, member: Member, seq: int, first: int, count: int) -> None:
        """Write fresh tags into tokens [first, first + count) of `seq`: K = tag + layer / 4,
        V = -K, in every head."""
        pool, storage = member.pool, member.storage
        size = pool.page_size
        pages = pool.table(seq).pages
        positions = range(first, first + count)
        tags = [float(next(self.next_tag)) for _ in positions]
        member.tags[seq].extend(tags)
        if not count:
            return
        slot_pages = torch.tensor([pages[t // size] for t in positions], device=DEVICE)
        slot_offsets = torch.tensor([t % size for t in positions], device=DEVICE)
        base = torch.tensor(tags, dtype=torch.float64, device=DEVICE).view(-1, 1, 1)
        base = base.expand(-1, storage.num_kv_heads, storage.head_dim)
        for layer in range(storage.num_layers):
            k = base + layer / 4
            storage.write(layer, slot_pages, slot_offsets, k, -k)

    def _check_sequence(self, member: Member, seq: int) -> None:
        pool, storage = member.pool, member.storage
        expected = member.tags[seq]
        table = pool.table(seq)
        assert table.num_tokens == len(expected)
        if not expected:
            return
        layers, heads, dim = storage.num_layers, storage.num_kv_heads, storage.head_dim
        pages = storage.read_pages(table.pages)  # [n, layers, 2, page_size, heads, dim]
        tokens = pages.permute(0, 3, 1, 2, 4, 5).reshape(-1, layers, 2, heads, dim)
        tags = torch.tensor(expected, dtype=torch.float64, device=DEVICE).view(-1, 1, 1, 1, 1)
        layer = (torch.arange(layers, device=DEVICE, dtype=torch.float64) / 4).view(1, -1, 1, 1, 1)
        sign = torch.tensor([1.0, -1.0], dtype=torch.float64, device=DEVICE).view(1, 1, 2, 1, 1)
        want = ((tags + layer) * sign).expand(-1, layers, 2, heads, dim)
        assert torch.equal(tokens[: len(expected)], want), f"pool {member.name}: {seq} lost tokens"

    def _snapshot(self) -> tuple:
        return tuple(m.snapshot() for m in self.members.values())

    # ---- requests and the prefix cache ----------------------------------------------------

    @rule(target=sequences, data=st.data(), tokens=st.integers(0, 12))
    def allocate(self, data: st.DataObject, tokens: int):
        member = self.members[data.draw(st.sampled_from(sorted(self.members)))]
        seq = next(self.ids)
        if not member.pool.can_allocate(tokens):
            before = self._snapshot()
            try:
                member.pool.allocate(seq, tokens)
            except PoolExhausted:
                assert self._snapshot() == before
                return None
            raise AssertionError("allocate succeeded although can_allocate said no")
        member.pool.allocate(seq, tokens)
        member.tags[seq] = []
        self._write(member, seq, 0, tokens)
        return (member.name, seq)

    def _live(self, ref: tuple[str, int] | None) -> tuple[Member, int] | None:
        if ref is None or ref[1] not in self.members[ref[0]].tags:
            return None
        return self.members[ref[0]], ref[1]

    @rule(ref=sequences, tokens=st.integers(1, 9))
    def append(self, ref, tokens: int) -> None:
        if (live := self._live(ref)) is None:
            return
        member, seq = live
        pool = member.pool
        if not pool.can_append(seq, tokens):
            before = self._snapshot()
            try:
                pool.append(seq, tokens)
            except PoolExhausted:
                assert self._snapshot() == before
                return
            raise AssertionError("append succeeded although can_append said no")
        first = pool.table(seq).num_tokens
        copies = pool.append(seq, tokens)
        if copies:
            member.storage.copy_pages([c.src for c in copies], [c.dst for c in copies])
        self._write(member, seq, first, tokens)

    @rule(ref=consumes(sequences))
    def free(self, ref) -> None:
        if (live := self._live(ref)) is None:
            return
        member, seq = live
        member.pool.free(seq)
        del member.tags[seq]

    @rule(data=st.data())
    def older_requests_finish(self, data: st.DataObject) -> None:
        """Every sequence of a pool but the newest ends: what is left tends to sit high in the
        pool, so a shrink (or a donor's) has to move it down."""
        member = self.members[data.draw(st.sampled_from(sorted(self.members)))]
        for seq in sorted(member.tags)[:-1]:
            member.pool.free(seq)
            del member.tags[seq]

    @rule(ref=sequences)
    def cache_pages(self, ref) -> None:
        """The prefix cache takes the sequence's pages; their contents must now stay fixed
        until it lets them go (or its evictor frees them)."""
        if (live := self._live(ref)) is None:
            return
        member, seq = live
        pages = [p for p in member.pool.table(seq).pages if p not in member.held]
        if pages:
            member.pool.holds.hold(pages)
            for page, contents in zip(pages, member.storage.read_pages(pages), strict=True):
                member.held[page] = contents

    @precondition(lambda self: any(m.held for m in self.members.values()))
    @rule(data=st.data(), count=st.integers(1, 4))
    def release_cached(self, data: st.DataObject, count: int) -> None:
        names = sorted(name for name, m in self.members.items() if m.held)
        member = self.members[data.draw(st.sampled_from(names))]
        victims = sorted(member.held)[:count]
        member.pool.holds.release(victims)
        for page in victims:
            del member.held[page]

    # ---- the operator ---------------------------------------------------------------------

    @rule(data=st.data(), segments=st.integers(1, 3))
    def grow(self, data: st.DataObject, segments: int) -> None:
        """Refused exactly when over the ceiling or the unassigned budget; refused, nothing
        changed."""
        member = self.members[data.draw(st.sampled_from(sorted(self.members)))]
        pool = member.pool
        target = pool.capacity + segments * member.segment
        extra = (target - pool.capacity) * member.page_bytes
        refused = target > member.resizer.max_pages or extra > self.budget.unassigned_bytes
        before, unassigned = self._snapshot(), self.budget.unassigned_bytes
        try:
            result = member.resizer.resize(target)
        except ResizeRefused as error:
            assert refused, f"grow to {target} refused: {error}"
            assert (self._snapshot(), self.budget.unassigned_bytes) == (before, unassigned)
            if extra > unassigned:
                event("grow refused by the budget")
            return
        assert not refused, f"grow to {target} went over the ceiling or the budget"
        assert result.new_pages == target == pool.capacity == member.storage.num_pages
        assert self.budget.unassigned_bytes == unassigned - extra

    @rule(data=st.data(), segments=st.integers(1, 3))
    def shrink(self, data: st.DataObject, segments: int) -> None:
        """Refused exactly below the floor, the promised pages or the used pages (cached pages
        are evicted); refused, nothing changed."""
        member = self.members[data.draw(st.sampled_from(sorted(self.members)))]
        pool = member.pool
        target = pool.capacity - segments * member.segment
        refused = (
            target < 1
            or target < member.resizer.min_pages
            or target < member.promised
            or target < pool.used_pages
        )
        before, unassigned = self._snapshot(), self.budget.unassigned_bytes
        freed = (pool.capacity - target) * member.page_bytes
        try:
            result = member.resizer.resize(target)
        except ResizeRefused as error:
            assert refused, f"shrink to {target} refused: {error}"
            assert (self._snapshot(), self.budget.unassigned_bytes) == (before, unassigned)
            return
        assert not refused, f"shrink to {target} went below what the pool must keep"
        assert result.new_pages == target == pool.capacity == member.storage.num_pages
        assert self.budget.unassigned_bytes == unassigned + freed
        if result.pages_evicted:
            event("shrink evicted cached pages")
        if result.pages_moved:
            event("shrink moved pages")

    @rule(data=st.data(), pinned=st.booleans())
    def pin(self, data: st.DataObject, pinned: bool) -> None:
        name = data.draw(st.sampled_from(sorted(self.members)))
        self.budget.pools[name].pinned = pinned

    # ---- the agent's checks ---------------------------------------------------------------

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0]))
    def tick(self, seconds: float) -> None:
        self.now += seconds

    @rule(data=st.data(), seconds=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def observe(self, data: st.DataObject, seconds: float) -> None:
        """A check: time passes, then each pool reports its pressure and promised pages (at
        most its capacity: the engine admits only requests that fit)."""
        self.now += seconds
        readings = {}
        for name, member in self.members.items():
            pressure = data.draw(pressures, label=f"{name} pressure")
            member.promised = data.draw(
                st.one_of(st.just(0), st.integers(0, member.pool.capacity)),
                label=f"{name} promised",
            )
            readings[name] = (pressure, member.promised)
            self._model_reading(member, pressure)
        self.rebalancer.observe(readings)

    @rule(data=st.data(), seconds=st.sampled_from([0.5, 1.0, 3.0]))
    def load_shifts(self, data: st.DataObject, seconds: float) -> None:
        """Checks over `seconds` where one pool stays short of pages and the others idle, then
        a rebalance (what makes memory move: random readings alone rarely line up for it)."""
        busy = data.draw(st.sampled_from(sorted(self.members)), label="busy pool")
        short = data.draw(st.integers(1, 40), label="short pages")
        for elapsed in (0.0, seconds):
            self.now += elapsed
            readings = {}
            for name, member in self.members.items():
                pressure = Pressure(short_pages=short) if name == busy else NO_PRESSURE
                readings[name] = (pressure, member.promised)
                self._model_reading(member, pressure)
            self.rebalancer.observe(readings)
        self.rebalance()

    def _model_reading(self, member: Member, pressure: Pressure) -> None:
        if pressure.any:
            member.calm_since = None
            if member.pressured_since is None:
                member.pressured_since = self.now
        else:
            member.pressured_since = None
            if member.calm_since is None:
                member.calm_since = self.now

    def _may_take(self, member: Member) -> bool:
        s = self.settings
        return member.pressured_since is not None and (
            (
                self.now - member.pressured_since >= s.pressure_s
                and self.now - member.gave_at >= s.cooldown_s
            )
            or self._may_take_back(member)
        )

    def _may_take_back(self, member: Member) -> bool:
        """Below its share and under pressure for `reclaim_s`: no cooldown holds it."""
        share = self.budget.pools[member.name].share_pages
        return (
            member.pressured_since is not None
            and self.now - member.pressured_since >= self.settings.reclaim_s
            and member.pool.capacity < share
        )

    def _may_give(self, member: Member) -> bool:
        s = self.settings
        return (
            member.calm_since is not None
            and self.now - member.calm_since >= s.calm_s
            and self.now - member.took_at >= s.cooldown_s
        )

    def _check_gave(
        self, name: str, delta: int, used: int, above_share: bool, reclaiming: bool
    ) -> None:
        """A donor gave `-delta` bytes: it was calm long enough, or a pool below its share took
        memory back, and it kept what it must keep."""
        m, s = self.members[name], self.settings
        share = self.budget.pools[name].share_pages
        if self._may_give(m):
            keep = max(m.resizer.min_pages, m.promised, used + int(used * s.headroom_ratio))
            if reclaiming and above_share:
                keep = min(keep, max(share, m.resizer.min_pages, m.promised))
        else:
            assert reclaiming and above_share, f"{name} gave memory without being calm long enough"
            keep = max(share, m.resizer.min_pages, m.promised, used)
            event("a busy pool gave memory back to a pool below its share")
        assert m.pool.capacity >= keep, f"donor {name} shrank below what it must keep"
        m.gave_at = self.now
        m.bytes_out -= delta
        event("a pool gave memory")
        if used:
            event("a donor with pages in use gave memory")
        if m.resizer.last_evacuation and m.resizer.last_evacuation.pages_moved:
            event("a donor moved pages to give memory")

    @rule()
    def rebalance(self) -> None:
        members, budget, s = self.members, self.budget, self.settings
        capacity = {name: m.pool.capacity for name, m in members.items()}
        used = {name: m.pool.used_pages for name, m in members.items()}
        pinned = {name: budget.pools[name].pinned for name in members}
        unassigned = budget.unassigned_bytes
        # a pool that may take, is below its ceiling and could get one of its segments from
        # the unassigned budget alone: some move must happen
        hungry = [
            name
            for name, m in members.items()
            if s.enabled
            and not pinned[name]
            and self._may_take(m)
            and capacity[name] < m.resizer.max_pages
            and unassigned >= m.segment * m.page_bytes
        ]
        # a pool above its share gives, busy or not, when one below its share takes it back
        reclaiming = s.enabled and any(
            not pinned[name] and self._may_take_back(m) for name, m in members.items()
        )
        shares = {name: budget.pools[name].share_pages for name in members}
        may_take = {name: self._may_take(m) for name, m in members.items()}
        moves = self.rebalancer.rebalance()
        if not s.enabled:
            assert moves == []
        if hungry:
            assert moves, f"{hungry} may take and the budget has room, yet nothing moved"
        for move in moves:
            event(f"a move from {len(move.given)} donors")
        taken = {name: 0 for name in members}
        given = {name: 0 for name in members}
        for move in moves:
            taken[move.taker] += move.taken_bytes
            for donor, gave in move.given.items():
                given[donor] += gave
        for name, m in members.items():
            pool = m.pool
            delta = (pool.capacity - capacity[name]) * m.page_bytes
            assert pool.used_pages == used[name], f"{name}: a move changed the pages in use"
            assert delta == taken[name] - given[name], f"{name}: moves misreport its bytes"
            assert not (taken[name] and given[name]), f"{name} took and gave at one check"
            if pinned[name]:
                assert delta == 0, f"pinned pool {name} was resized by the rebalancer"
            if delta > 0:
                assert may_take[name], f"{name} took memory without the pressure for it"
                assert pool.capacity <= m.resizer.max_pages
                m.took_at = self.now
                m.bytes_in += delta
                event("a pool took memory")
            if delta < 0:
                self._check_gave(name, delta, used[name], capacity[name] > shares[name], reclaiming)
            seen = self.rebalancer.history[name]
            assert (seen.moved_bytes["in"], seen.moved_bytes["out"]) == (m.bytes_in, m.bytes_out)
        assert budget.unassigned_bytes == unassigned + sum(given.values()) - sum(taken.values())

    # ---- after every step -----------------------------------------------------------------

    @invariant()
    def budget_contents_and_bookkeeping_hold(self) -> None:
        if not hasattr(self, "budget"):
            return
        self.budget.check()
        total = sum(m.pool.capacity * m.page_bytes for m in self.members.values())
        assert total == self.budget.assigned_bytes <= self.budget.total_bytes
        for member in self.members.values():
            pool, storage = member.pool, member.storage
            pool.invariants.check()
            assert storage.num_pages == pool.capacity
            assert storage.nbytes == pool.capacity * pool.bytes_per_page
            assert member.resizer.min_pages <= pool.capacity <= member.resizer.max_pages
            for seq in member.tags:
                self._check_sequence(member, seq)
            for page, contents in member.held.items():
                assert pool.pages.state(page) in (PageState.USED, PageState.CACHED)
                assert torch.equal(storage.read_pages([page])[0], contents), f"page {page}"


BudgetMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=100, deadline=None)
TestBudgetMachine = BudgetMachine.TestCase
