"""Which cached prefix goes first when the pool needs pages: the eviction policies.

Eviction is leaf-first: only the last pages of a branch can go, because every page further down
depends on the tokens of the pages above it. Among the leaves, a policy orders by a priority
(the lowest goes first) computed from what every node records whatever the policy: the tick it
was created, the tick it was last matched or inserted, and how many requests it served. So the
policy can change at run time without rebuilding anything.

Ticks come from the cache's logical clock (one tick per match or insert), not wall time, so the
order is exact and the same on every machine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from kvctl.agent.prefix.radix_tree import RadixNode


class EvictionPolicy(ABC):
    """Orders evictable leaves: the smallest `priority` is evicted first."""

    name: ClassVar[str]

    @abstractmethod
    def priority(self, node: RadixNode) -> tuple[int, ...]: ...


class LeastRecentlyUsed(EvictionPolicy):
    """The leaf matched or inserted longest ago goes first (the default)."""

    name = "lru"

    def priority(self, node: RadixNode) -> tuple[int, ...]:
        return (node.last_access, node.node_id)


class LeastFrequentlyUsed(EvictionPolicy):
    """The leaf that served the fewest requests goes first; the least recent among equals."""

    name = "lfu"

    def priority(self, node: RadixNode) -> tuple[int, ...]:
        return (node.hits, node.last_access, node.node_id)


class FirstInFirstOut(EvictionPolicy):
    """The leaf inserted first goes first, however often it is used."""

    name = "fifo"

    def priority(self, node: RadixNode) -> tuple[int, ...]:
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
