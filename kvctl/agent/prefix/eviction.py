"""Which cached prefix goes first when the pool needs pages: the eviction policies.

Eviction is leaf-first: only the last pages of a branch can go, because every page further down
depends on the tokens of the pages above it. Among the leaves, a policy orders by a priority
(the lowest goes first) computed from what every node records whatever the policy: the tick it
was created, the tick it was last matched or inserted, and how many requests it served. So the
policy can change at run time without rebuilding anything.

Ticks come from the cache's logical clock (one tick per match or insert), not wall time, so the
order is exact and the same on every machine.

`EvictionOrder` keeps the leaves in policy order as the trees change, so an eviction costs
O(log n) per leaf it frees rather than a sort of every leaf per call.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar, Protocol

from kvctl.agent.prefix.radix_tree import RadixNode, RadixTree


class Recorded(Protocol):
    """What a policy reads of an entry: a radix-tree node, or a page of a tier below the pool."""

    @property
    def node_id(self) -> int: ...

    @property
    def created(self) -> int: ...

    @property
    def last_access(self) -> int: ...

    @property
    def hits(self) -> int: ...


class EvictionPolicy(ABC):
    """Orders evictable leaves: the smallest `priority` is evicted first.

    A node's priority must never decrease while it is in a tree (a use can only move it later):
    `EvictionOrder` relies on it to leave a used leaf where it is and look again only when the
    leaf comes first. The clock and the use count only grow, so all three policies qualify.
    """

    name: ClassVar[str]

    @abstractmethod
    def priority(self, node: Recorded) -> tuple[int, ...]: ...


class LeastRecentlyUsed(EvictionPolicy):
    """The leaf matched or inserted longest ago goes first (the default)."""

    name = "lru"

    def priority(self, node: Recorded) -> tuple[int, ...]:
        return (node.last_access, node.node_id)


class LeastFrequentlyUsed(EvictionPolicy):
    """The leaf that served the fewest requests goes first; the least recent among equals."""

    name = "lfu"

    def priority(self, node: Recorded) -> tuple[int, ...]:
        return (node.hits, node.last_access, node.node_id)


class FirstInFirstOut(EvictionPolicy):
    """The leaf inserted first goes first, however often it is used."""

    name = "fifo"

    def priority(self, node: Recorded) -> tuple[int, ...]:
        return (node.created, node.node_id)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    policy.name: policy for policy in (LeastRecentlyUsed, LeastFrequentlyUsed, FirstInFirstOut)
}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called `name`; ValueError naming the choices when there is none."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        choices = ", ".join(EVICTION_POLICIES)
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {choices}") from None


_Entry = tuple[tuple[int, ...], int, RadixNode, RadixTree]
"""A heap entry: the leaf's priority when queued, a tie-breaking sequence number, the leaf, its
tree."""


class EvictionOrder:
    """The leaves of one cache's trees, kept in `policy` order as the trees change.

    A heap of `(priority, seq, node, tree)` with at most one entry per node (`node.queued`).
    Entries are checked lazily, when they come to the top: a node that stopped being a leaf (it
    gained a child, or was removed) is dropped; a leaf used since it was queued has a stale,
    smaller priority and goes back with its current one (priorities never decrease, so the top
    entry, once current, is the true first). A use costs nothing here, a new leaf one push, and
    taking the first leaf O(log n) per entry popped on the way.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._heap: list[_Entry] = []
        self._seq = 0  # between equal priorities, the first queued goes first

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, node: RadixNode, tree: RadixTree) -> None:
        """Queue a node that became a leaf (nothing to do if it is queued already: its entry's
        priority is a lower bound of its current one)."""
        if not node.queued:
            node.queued = True
            self._seq += 1
            heapq.heappush(self._heap, (self.policy.priority(node), self._seq, node, tree))

    def pop(self) -> tuple[RadixNode, RadixTree] | None:
        """Take the first leaf in policy order out of the order (`add` it back if it stays a
        leaf); None when there are no leaves."""
        if not self._settle(self._heap, forget=True):
            return None
        _, _, node, tree = heapq.heappop(self._heap)
        node.queued = False
        return node, tree

    def _settle(self, heap: list[_Entry], forget: bool) -> bool:
        """Bring a current leaf's entry to the top of `heap`: drop the entries of nodes that are
        no longer leaves, queue again the leaves used since; False when none is left. `forget`
        marks dropped nodes as not queued (`heap` is the order's own)."""
        priority = self.policy.priority
        while heap:
            stored, _, node, tree = heap[0]
            if node.parent is None or node.children:
                heapq.heappop(heap)
                if forget:
                    node.queued = False
                continue
            current = priority(node)
            if current == stored:
                return True
            self._seq += 1
            heapq.heapreplace(heap, (current, self._seq, node, tree))
        return False

    def rebuild(
        self, policy: EvictionPolicy, leaves: Iterable[tuple[RadixNode, RadixTree]]
    ) -> None:
        """Order `leaves` afresh under `policy` (a policy change)."""
        for _, _, node, _ in self._heap:
            node.queued = False
        self.policy = policy
        priority = policy.priority
        heap = [(priority(node), seq, node, tree) for seq, (node, tree) in enumerate(leaves)]
        self._seq = len(heap)
        heapq.heapify(heap)
        for _, _, node, _ in heap:
            node.queued = True
        self._heap = heap

    def ordered(self) -> list[tuple[RadixNode, RadixTree]]:
        """Every leaf, in the order `pop` would give them; changes nothing (for checks)."""
        heap = list(self._heap)
        order = []
        while self._settle(heap, forget=False):
            _, _, node, tree = heapq.heappop(heap)
            order.append((node, tree))
        return order

    def problems(self, leaves: Iterable[tuple[RadixNode, RadixTree]]) -> list[str]:
        """Every way the order disagrees with `leaves` (all the trees' leaves), described."""
        problems: list[str] = []
        queued = [node for _, _, node, _ in self._heap]
        if len(set(map(id, queued))) != len(queued):
            problems.append("a node has two entries in the eviction order")
        if not all(node.queued for node in queued):
            problems.append("a node in the eviction order is not marked as queued")
        entries = {id(node): (stored, tree) for stored, _, node, tree in self._heap}
        priority = self.policy.priority
        for node, tree in leaves:
            entry = entries.get(id(node))
            if entry is None:
                problems.append(f"leaf {node.node_id} is missing from the eviction order")
            elif entry[1] is not tree:
                problems.append(f"leaf {node.node_id} is queued under another tree")
            elif entry[0] > priority(node):
                problems.append(f"leaf {node.node_id} is queued later than its priority")
        return problems
