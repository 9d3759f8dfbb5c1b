"""Attention whose K/V live in the page pool: the paged counterpart of `ContiguousKVCache`.

Each step the engine first makes room in the pool (allocate, append), then `begin_step` turns the
batch's page tables into index tensors once: the slot (page, offset) of every new token for the
writes, and the page ids of every sequence for the reads. Every layer then writes its new K/V
into those slots and gathers whole pages back by id. The attention math is the shared
`attend_one` / `attend_decode`, so paged and contiguous caches compute identically.

Page tables are read afresh at every `begin_step`, so whatever the defragmenter moved between two
steps is invisible to the model: it reads the same values from their new pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvctl.agent.model.attention import (
    BatchLayout,
    attend_decode,
    attend_one,
    key_mask,
    split_by_sequence,
)
from kvctl.agent.pool import PagePool
from kvctl.agent.pool.storage import KVStorage, PageIndex, SlotIndex


@dataclass(frozen=True)
class _StepIndex:
    """Index tensors of one step, built once and used by every layer."""

    layout: BatchLayout
    slots: SlotIndex  # where each new token's K/V goes
    pages: tuple[PageIndex, ...]  # decode: one [B, P] index; otherwise one [1, P_i] per sequence
    valid: Tensor | None  # decode: Bool [B, P * page_size], the keys that exist


class PagedKVCache:
    """An `AttentionBackend` reading and writing K/V through the pool's page tables."""

    def __init__(self, pool: PagePool, storage: KVStorage) -> None:
        self.pool = pool
        self.storage = storage
        self._step: _StepIndex | None = None
        # Decode gathers into one K/V buffer pair, reused by every layer of every step and grown
        # to the largest batch seen: a fresh allocation per layer costs as much as a tenth of the
        # gather itself on a CPU.
        self._buffers: tuple[Tensor, Tensor] | None = None

    def begin_step(self, layout: BatchLayout) -> None:
        """Prepare a forward over `layout`; every sequence's pages must already hold room for
        its `total_lens` tokens.

        Index arrays are built with numpy and handed to torch once: on a CPU each small torch op
        costs tens of microseconds of dispatch, which adds up to a visible share of a step.
        """
        page_size = self.pool.page_size
        tables = [self.pool.table(s).pages for s in layout.seq_ids]
        slot_pages: list[int] = []
        slot_offsets: list[int] = []
        for pages, cached, new in zip(tables, layout.cached_lens, layout.new_lens, strict=True):
            for position in range(cached, cached + new):
                slot_pages.append(pages[position // page_size])
                slot_offsets.append(position % page_size)
        slots = self.storage.index_slots(_long(slot_pages), _long(slot_offsets))
        lengths = layout.total_lens
        if layout.is_decode:
            needed = [-(-n // page_size) for n in lengths]
            width = max(needed)
            padded: list[int] = []
            for p, n in zip(tables, needed, strict=True):
                padded += p[:n]
                padded += [p[0]] * (width - n)
            pages = (self.storage.index_pages(_long(padded).view(len(tables), width)),)
            valid = key_mask(lengths, width * page_size, self.storage.device)
            self._ensure_buffers(len(tables) * width)
        else:
            pages = tuple(
                self.storage.index_pages(_long(p[: -(-n // page_size)]).view(1, -1))
                for p, n in zip(tables, lengths, strict=True)
            )
            valid = None
        self._step = _StepIndex(layout, slots, pages, valid)

    def _ensure_buffers(self, pages: int) -> None:
        if self._buffers is None or self._buffers[0].shape[0] < pages:
            self._buffers = self.storage.gather_buffers(pages)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """See `AttentionBackend.attend`: store the new K/V in their pages, then attend."""
        step = self._step
        if step is None:
            raise RuntimeError("call begin_step(layout) before the forward")
        self.storage.write(layer, step.slots, None, k, v)
        if step.valid is not None:
            keys, values = self.storage.gather(
                layer, step.pages[0], self._buffers
            )  # [B, L, kvh, d]
            return attend_decode(q, keys, values, step.valid)
        return self._attend_each(layer, q, step)

    def _attend_each(self, layer: int, q: Tensor, step: _StepIndex) -> Tensor:
        layout = step.layout
        outs: list[Tensor] = []
        queries: Sequence[Tensor] = split_by_sequence(q, layout.new_lens)
        for q_i, index, cached, total in zip(
            queries, step.pages, layout.cached_lens, layout.total_lens, strict=True
        ):
            keys, values = self.storage.gather(layer, index)  # [1, P * page_size, kvh, d]
            outs.append(attend_one(q_i, keys[0, :total], values[0, :total], cached))
        return torch.cat(outs)  # [T, h, d]


def _long(values: Sequence[int]) -> Tensor:
    """A host int64 tensor of `values`, built through numpy (one conversion, no torch dispatch)."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))
