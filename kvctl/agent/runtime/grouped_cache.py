"""Attention for a model whose layers keep their K/V in page groups (`layer_groups`).

Each group's pages hold the K/V of its own layers, and each sequence has a page table per
group, so the sliding groups can give back the pages their window has left while the full
groups keep theirs. This backend is one `PagedKVCache` per group, each reading that group's
tables (pool sequence `(seq_id, group)`) and its layers' slots of the shared storage; a layer's
`attend` goes to its group's cache, which computes exactly as for an ungrouped model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import Tensor

from kvctl.agent.model.attention import FULL, BatchLayout, LayerAttention
from kvctl.agent.pool import PagePool
from kvctl.agent.pool.storage import KVStorage
from kvctl.agent.runtime.layer_groups import LayerGroups
from kvctl.agent.runtime.paged_cache import PagedKVCache, ReadPath


class GroupedKVCache:
    """An `AttentionBackend` that routes each layer to its page group's `PagedKVCache`."""

    def __init__(
        self,
        groups: LayerGroups,
        pool: PagePool,
        storage: KVStorage,
        read_path: ReadPath = "auto",
        num_heads: int | None = None,
        kernels: bool = True,
        layers: Sequence[LayerAttention] = (),
    ) -> None:
        self.groups = groups
        seen = tuple(layers) or (FULL,) * len(groups.slots)
        self.caches = [
            PagedKVCache(
                pool, storage, read_path, num_heads, kernels, _slots_of(groups, group, seen)
            )
            for group in range(groups.count)
        ]
        self._route = [(self.caches[group], slot) for group, slot in groups.slots]

    @property
    def decode_reads_in_place(self) -> bool:
        return self.caches[0].decode_reads_in_place

    @property
    def decode_read_path(self) -> str:
        return self.caches[0].decode_read_path

    def begin_step(self, layout: BatchLayout) -> None:
        for group, cache in enumerate(self.caches):
            ids = tuple((seq_id, group) for seq_id in layout.seq_ids)
            cache.begin_step(dataclasses.replace(layout, seq_ids=ids))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache, slot = self._route[layer]
        return cache.attend(slot, q, k, v)


def _slots_of(
    groups: LayerGroups, group: int, layers: Sequence[LayerAttention]
) -> tuple[LayerAttention, ...]:
    """How each slot of `group`'s pages is attended: its layer's, and an unused slot (the
    padding of the last group of a kind) as the group's first layer."""
    members = [layers[layer] for layer in groups.layers_of(group)]
    return tuple(members + members[:1] * (groups.size - len(members)))
