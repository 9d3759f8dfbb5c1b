"""Attention whose K/V live in the page pool: the paged counterpart of `ContiguousKVCache`.

Each step the engine first makes room in the pool (allocate, append), then `begin_step` turns the
batch's page tables into index tensors once: the slot (page, offset) of every new token for the
writes, and how every sequence's pages are read. Every layer then writes its new K/V into those
slots and attends over the pages. The attention math is the shared `attend_one` /
`attend_decode` (through `paged_attention`), so paged and contiguous caches compute identically.

Reads, by step kind:

- prefill (or any step with several tokens for some sequence): per sequence, a run of pages in
  one segment is read as a view of storage (`KVStorage.read_sequence`), any other table is
  gathered; either way they are attended with their own head count (no repeat per query head),
  under a mask built once per step for all layers (`chunk_mask`). In a mixed step
  (decode tokens and prompt chunks together, chunked prefill), the sequences with one new token
  are read as in a gathered decode, in one SDPA call, and only the chunks one by one.
- decode, read path "paged" (the CPU default where the project's kernels run): one kernel call
  per layer attends the whole batch, reading each sequence's pages where they lie through its
  page table (`kvctl.agent.kernels`, `paged_decode_attention`); nothing is gathered.
- decode, read path "gather": every sequence's pages are gathered into one padded buffer, reused
  by every layer and step, and one SDPA call attends the whole batch.
- decode, read path "flex": FlexAttention reads the pages in place through block tables built
  from the page tables (`PageTableAttention`); sequences whose pages lie in several segments are
  gathered as above and the two results are put back in batch order.

"auto" (the default) is "flex" on CUDA, "paged" on a CPU where the kernels are built and have
the model's head layout (head dim 16, 32, 64, 128 or 256; up to 8 query heads per KV head;
float32 or bfloat16 pages), and "gather" elsewhere. In a mixed step the one-token rows take the
decode read path too. If FlexAttention fails under "auto" (a compiler that cannot build its
kernel), the cache logs it once and gathers from then on.

Page tables are read afresh at every `begin_step`, so whatever the defragmenter moved between two
steps is invisible to the model: it reads the same values from their new pages.

Layers with a sliding window (`LayerAttention`) read only the pages holding keys their queries
see: a prompt chunk's read starts at the page of its first visible key and its mask hides the
rest, the paged kernel skips the pages before the window, and a gathered decode masks them. Such
a model (or one with soft-capped scores) decodes by "paged" or "gather", never "flex".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from kvctl.agent.kernels import cpu_ops
from kvctl.agent.model.attention import (
    FULL,
    BatchLayout,
    LayerAttention,
    attend_decode,
    chunk_mask,
    key_mask,
    split_by_sequence,
)
from kvctl.agent.model.paged_attention import (
    BlockPlan,
    PageTableAttention,
    attend_pages,
    flex_available,
)
from kvctl.agent.pool import PagePool
from kvctl.agent.pool.storage import BatchIndex, KVStorage, PageIndex, SlotIndex

log = logging.getLogger(__name__)

ReadPath = Literal["auto", "paged", "gather", "flex"]
READ_PATHS: tuple[ReadPath, ...] = ("auto", "paged", "gather", "flex")

_Run = tuple[int, int, int]
"""A sequence read as a view: (segment, first row, pages)."""


Window = int | None
"""A layer's sliding window (None: it sees every key)."""


@dataclass(frozen=True)
class _Gathered:
    """One-token rows read through one padded gather: their rows of the flat batch (None: the
    whole batch in order), gather plan `[b, P]` and key mask `[b, P * page_size]` per window."""

    rows: Tensor | None
    pages: BatchIndex
    valid: dict[Window, Tensor]


@dataclass(frozen=True)
class _KernelSlots:
    """Where each new token's K/V goes, for the kernel's `write_kv`: page and offset per token
    (int32)."""

    pages: Tensor
    offsets: Tensor


@dataclass(frozen=True)
class _PagedRows:
    """One-token rows read by the paged kernel: their rows of the flat batch (None: the whole
    batch in order), page tables `[b, P]` int32 and lengths `[b]` int32 (the new token
    included)."""

    rows: Tensor | None
    tables: Tensor
    lengths: Tensor


@dataclass(frozen=True)
class _StepIndex:
    """Index tensors of one step, built once and used by every layer."""

    layout: BatchLayout
    slots: SlotIndex | _KernelSlots  # where each new token's K/V goes
    reads: dict[Window, _Reads]  # not decode: per window, how each sequence is read
    gathered: _Gathered | _PagedRows | None  # the one-token rows: gathered or paged
    blocks: BlockPlan | None  # decode: the rows read in place, by segment
    tables: tuple[list[int], ...]  # decode: the page tables, to fall back to gathering


@dataclass(frozen=True)
class _Reads:
    """How a step with several new tokens for some sequence reads each sequence for layers of
    one window: `pages` a view, a [1, P_i] index, or None for a one-token sequence of a mixed
    step (read in `gathered`); `first` the position of the first key read (a page boundary);
    `masks` each read's chunk mask."""

    pages: tuple[_Run | PageIndex | None, ...]
    first: tuple[int, ...]
    masks: tuple[Tensor | None, ...]


class PagedKVCache:
    """An `AttentionBackend` reading and writing K/V through the pool's page tables."""

    def __init__(
        self,
        pool: PagePool,
        storage: KVStorage,
        read_path: ReadPath = "auto",
        num_heads: int | None = None,
        kernels: bool = True,
        layers: Sequence[LayerAttention] = (),
    ) -> None:
        """`layers`: each layer's `LayerAttention` (empty: every layer sees every key)."""
        if read_path not in READ_PATHS:
            raise ValueError(f"read_path must be one of {', '.join(READ_PATHS)}, not {read_path!r}")
        self.pool = pool
        self.storage = storage
        self.read_path = read_path
        self._step: _StepIndex | None = None
        # Decode gathers into one K/V buffer pair, reused by every layer of every step and grown
        # to the largest batch seen: a fresh allocation per layer costs as much as a tenth of the
        # gather itself on a CPU.
        self._buffers: tuple[Tensor, Tensor] | None = None
        # the last gather's page tables and layout: decode steps mostly read the same pages as
        # the step before (a sequence takes a new page every `page_size` steps)
        self._last_gather: tuple[list[list[int]], BatchIndex] | None = None
        self._layers = tuple(layers) or (FULL,) * storage.num_layers
        self._windows = {seen.window for seen in self._layers}
        plain = all(seen == FULL and seen.sinks is None for seen in self._layers)
        if read_path == "flex" and not plain:
            raise ValueError(
                "read path 'flex' cannot apply sliding windows, soft-capped scores or sinks"
            )
        in_place = read_path == "flex" or (
            read_path == "auto" and storage.device.type == "cuda" and flex_available() and plain
        )
        self._in_place = PageTableAttention(storage) if in_place else None
        self._kernel = _paged_kernel(storage, read_path, num_heads) if kernels else None
        if read_path == "paged" and self._kernel is None:
            raise ValueError("read path 'paged' needs the CPU kernels, which are turned off")
        self._scale: float | None = None

    @property
    def decode_reads_in_place(self) -> bool:
        """Whether decode reads pages where they lie (False: it gathers them)."""
        return self._in_place is not None or self._kernel is not None

    @property
    def decode_read_path(self) -> str:
        """The decode read path in use: "paged", "flex" or "gather"."""
        if self._kernel is not None:
            return "paged"
        return "flex" if self._in_place is not None else "gather"

    def begin_step(self, layout: BatchLayout) -> None:
        """Prepare a forward over `layout`; every sequence's pages must already hold room for
        its `total_lens` tokens.

        Index arrays are built with numpy and handed to torch once: on a CPU each small torch op
        costs tens of microseconds of dispatch, which adds up to a visible share of a step.
        """
        page_size = self.pool.page_size
        table = self.pool.table
        tables = [table(s).positional() for s in layout.seq_ids]
        if layout.is_decode:
            self._step = self._decode_step(layout, tables)
            return
        slot_pages: list[int] = []
        slot_offsets: list[int] = []
        for pages, cached, new in zip(tables, layout.cached_lens, layout.new_lens, strict=True):
            for position in range(cached, cached + new):
                slot_pages.append(pages[position // page_size])
                slot_offsets.append(position % page_size)
        slots = self._slots(np.asarray(slot_pages), np.asarray(slot_offsets))
        lengths = layout.total_lens
        used = tuple(p[: -(-n // page_size)] for p, n in zip(tables, lengths, strict=True))
        self._step = self._mixed_step(layout, slots, used)

    def _decode_step(self, layout: BatchLayout, tables: list[list[int]]) -> _StepIndex:
        """One new token per sequence: its slot is in the last page in use."""
        page_size = self.pool.page_size
        lengths = layout.total_lens
        used = tuple(p[: -(-n // page_size)] for p, n in zip(tables, lengths, strict=True))
        offsets = (np.asarray(lengths, dtype=np.int64) - 1) % page_size
        slots = self._slots(np.asarray([p[-1] for p in used]), offsets)
        if self._kernel is not None:
            paged = self._paged(used, lengths, range(len(used)))
            return _StepIndex(layout, slots, {}, paged, None, used)
        blocks = None
        rest: Sequence[int] = range(len(used))
        if self._in_place is not None:
            blocks = self._in_place.plan(used, lengths)
            rest = blocks.rest
        gathered = self._gathered(used, lengths, rest) if rest else None
        return _StepIndex(layout, slots, {}, gathered, blocks, used)

    def _slots(self, pages: np.ndarray, offsets: np.ndarray) -> SlotIndex | _KernelSlots:
        """Each new token's slot, in the form the write path takes."""
        if self._kernel is not None:
            as_int = [torch.from_numpy(a.astype(np.int32)) for a in (pages, offsets)]
            return _KernelSlots(*as_int)
        return self.storage.index_slots(_long(pages), _long(offsets))

    def _mixed_step(
        self, layout: BatchLayout, slots: SlotIndex | _KernelSlots, used: tuple[list[int], ...]
    ) -> _StepIndex:
        """A step with several new tokens for some sequence: those are read one by one, and the
        one-token sequences (decoding beside a prompt chunk) in one gathered batch."""
        singles = [i for i, n in enumerate(layout.new_lens) if n == 1]
        gathered: _Gathered | _PagedRows | None = None
        if len(singles) > 1 or (singles and self._kernel is not None):
            offsets = layout.offsets
            token_rows = [offsets[i] for i in singles]
            if self._kernel is not None:
                gathered = self._paged(used, layout.total_lens, singles, token_rows)
            else:
                gathered = self._gathered(used, layout.total_lens, singles, token_rows)
        batched = set(singles) if gathered is not None else set()
        reads = {window: self._reads(layout, used, batched, window) for window in self._windows}
        return _StepIndex(layout, slots, reads, gathered, None, ())

    def _reads(
        self, layout: BatchLayout, used: tuple[list[int], ...], batched: set[int], window: Window
    ) -> _Reads:
        """Each sequence's read for layers of `window`: from the page of the first key its
        first new token sees."""
        page_size = self.pool.page_size
        device, dtype = self.storage.device, self.storage.dtype
        seen = LayerAttention(window)
        pages: list[_Run | PageIndex | None] = []
        firsts: list[int] = []
        masks: list[Tensor | None] = []
        for i, (table, cached, n) in enumerate(
            zip(used, layout.cached_lens, layout.new_lens, strict=True)
        ):
            first = seen.first_key(cached) // page_size
            firsts.append(first * page_size)
            if i in batched:
                pages.append(None)
                masks.append(None)
                continue
            pages.append(self._sequence_read(table[first:]))
            masked = n > 1 or window is not None  # one token sees all its keys but a window's
            masks.append(
                chunk_mask(n, cached, device, dtype, window, first * page_size) if masked else None
            )
        return _Reads(tuple(pages), tuple(firsts), tuple(masks))

    def _sequence_read(self, pages: list[int]) -> _Run | PageIndex:
        run = self.storage.run_of(pages)
        if run is not None:
            return (run[0], run[1], len(pages))
        return self.storage.index_pages(_long(pages).view(1, -1))

    def _gathered(
        self,
        tables: Sequence[list[int]],
        lengths: Sequence[int],
        rows: Sequence[int],
        token_rows: Sequence[int] | None = None,
    ) -> _Gathered:
        """The padded gather of the sequences `rows`, one new token each, at `token_rows` of the
        flat batch (default: `rows`, a decode step's)."""
        picked = [tables[r] for r in rows]
        last = self._last_gather
        if last is not None and last[0] == picked:
            index = last[1]
        else:  # padding repeats a row's last page: one stretch of one segment more often
            width = max(map(len, picked))
            padded = np.array([p + p[-1:] * (width - len(p)) for p in picked], dtype=np.int64)
            index = self.storage.index_batch(padded)
            self._last_gather = (picked, index)
        row_lengths = [lengths[r] for r in rows]
        keys, device = index.shape[1] * self.pool.page_size, self.storage.device
        valid = {w: key_mask(row_lengths, keys, device, w) for w in self._windows}
        self._ensure_buffers(index.buffer_pages)
        whole = len(rows) == len(tables)  # rows ascend, so all of them means all in order
        if token_rows is None:
            token_rows = rows
        row_index = None if whole else _long(list(token_rows)).to(self.storage.device)
        return _Gathered(row_index, index, valid)

    def _paged(
        self,
        tables: Sequence[list[int]],
        lengths: Sequence[int],
        rows: Sequence[int],
        token_rows: Sequence[int] | None = None,
    ) -> _PagedRows:
        """The page tables and lengths of the one-token sequences `rows`, for the kernel."""
        picked = [tables[r] for r in rows]
        width = max(map(len, picked))
        padded = np.zeros((len(picked), width), dtype=np.int32)
        for i, pages in enumerate(picked):
            padded[i, : len(pages)] = pages
        counts = np.asarray([lengths[r] for r in rows], dtype=np.int32)
        whole = len(rows) == len(tables)
        if token_rows is None:
            token_rows = rows
        row_index = None if whole else _long(list(token_rows))
        return _PagedRows(row_index, torch.from_numpy(padded), torch.from_numpy(counts))

    def _ensure_buffers(self, pages: int) -> None:
        if self._buffers is None or self._buffers[0].shape[0] < pages:
            self._buffers = self.storage.gather_buffers(pages)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """See `AttentionBackend.attend`: store the new K/V in their pages, then attend."""
        step = self._step
        if step is None:
            raise RuntimeError("call begin_step(layout) before the forward")
        slots = step.slots
        if isinstance(slots, _KernelSlots):
            assert self._kernel is not None
            dtype = self.storage.dtype
            k, v = k.to(dtype), v.to(dtype)  # no-ops when the pages have the model's dtype
            self._kernel.write_kv(self.storage.segments, layer, slots.pages, slots.offsets, k, v)
        else:
            self.storage.write(layer, slots, None, k, v)
        if not step.layout.is_decode:
            return self._attend_each(layer, q, step)
        if isinstance(step.gathered, _PagedRows):
            return self._attend_paged(layer, q, step.gathered)
        if step.blocks is None or not step.blocks.tables:
            assert step.gathered is not None
            return self._attend_gathered(layer, q, step.gathered)
        try:
            return self._attend_in_place(layer, q, step, step.blocks)
        except Exception:
            if self.read_path != "auto":
                raise
            log.exception("FlexAttention failed; decode gathers pages from now on")
            self._in_place = None
            gathered = self._gathered(step.tables, step.layout.total_lens, range(len(step.tables)))
            self._step = _StepIndex(step.layout, step.slots, {}, gathered, None, step.tables)
            return self._attend_gathered(layer, q, gathered)

    def _attend_paged(self, layer: int, q: Tensor, paged: _PagedRows) -> Tensor:
        kernel = self._kernel
        assert kernel is not None
        rows = q if paged.rows is None else q.index_select(0, paged.rows)
        if self._scale is None:
            self._scale = rows.shape[-1] ** -0.5
        seen = self._layers[layer]
        out = kernel.paged_decode_attention(
            rows.float().contiguous(),
            self.storage.segments,
            paged.tables,
            paged.lengths,
            layer,
            self._scale,
            seen.window or 0,
            seen.softcap or 0.0,
            seen.sinks,
        )
        return out.to(q.dtype)

    def _attend_rows(self, layer: int, q: Tensor, rows: _Gathered | _PagedRows) -> Tensor:
        if isinstance(rows, _PagedRows):
            return self._attend_paged(layer, q, rows)
        return self._attend_gathered(layer, q, rows)

    def _attend_gathered(self, layer: int, q: Tensor, gathered: _Gathered) -> Tensor:
        assert self._buffers is not None
        keys, values = self.storage.gather_batch(layer, gathered.pages, self._buffers)
        rows = q if gathered.rows is None else q.index_select(0, gathered.rows)
        seen = self._layers[layer]
        return attend_decode(rows, keys, values, gathered.valid[seen.window], seen)

    def _attend_in_place(
        self, layer: int, q: Tensor, step: _StepIndex, blocks: BlockPlan
    ) -> Tensor:
        reader = self._in_place
        assert reader is not None
        if len(blocks.tables) == 1 and blocks.tables[0].rows is None:
            return reader.attend(layer, q, blocks.tables[0])
        out = torch.empty_like(q)
        for table in blocks.tables:
            assert table.rows is not None
            out.index_copy_(0, table.rows, reader.attend(layer, q, table))
        if step.gathered is not None:
            assert isinstance(step.gathered, _Gathered) and step.gathered.rows is not None
            out.index_copy_(0, step.gathered.rows, self._attend_gathered(layer, q, step.gathered))
        return out

    def _attend_each(self, layer: int, q: Tensor, step: _StepIndex) -> Tensor:
        layout = step.layout
        outs: list[Tensor] = []
        queries: Sequence[Tensor] = split_by_sequence(q, layout.new_lens)
        batched = None
        if step.gathered is not None:
            batched = self._attend_rows(layer, q, step.gathered)  # [singles, h, d]
        seen = self._layers[layer]
        reads = step.reads[seen.window]
        per_seq = zip(
            queries, reads.pages, layout.cached_lens, reads.first, reads.masks, strict=True
        )
        for q_i, read, cached, first, mask in per_seq:
            if read is None:
                continue
            if isinstance(read, PageIndex):
                keys, values = self.storage.gather(layer, read)  # [1, P * page_size, kvh, d]
                shape = (read.shape[1], self.storage.page_size, *keys.shape[2:])
                keys, values = keys.view(shape), values.view(shape)
            else:
                keys, values = self.storage.pages_view(layer, *read)  # [P, page_size, kvh, d]
            outs.append(attend_pages(q_i, keys, values, cached - first, mask, seen))
        if batched is None:
            return torch.cat(outs)  # [T, h, d]
        return self._merge(q, step, batched, outs, reads)

    def _merge(
        self, q: Tensor, step: _StepIndex, batched: Tensor, outs: list[Tensor], reads: _Reads
    ) -> Tensor:
        """Put a mixed step's gathered rows and per-sequence outputs back in batch order."""
        gathered = step.gathered
        assert gathered is not None and gathered.rows is not None
        out = torch.empty_like(q)
        out.index_copy_(0, gathered.rows, batched)
        pieces = iter(outs)
        for offset, n, read in zip(
            step.layout.offsets, step.layout.new_lens, reads.pages, strict=True
        ):
            if read is not None:
                out[offset : offset + n] = next(pieces)
        return out


def _paged_kernel(
    storage: KVStorage, read_path: ReadPath, num_heads: int | None
) -> ModuleType | None:
    """The CPU kernels when decode reads pages through them: "paged", or "auto" on a CPU where
    they are built and cover the model's head layout (`num_heads` query heads; unknown: not
    under "auto") and the pages' dtype; None otherwise. A "paged" that cannot run is a
    ValueError naming why."""
    if read_path not in ("auto", "paged"):
        return None
    kernels = cpu_ops() if storage.device.type == "cpu" else None
    if kernels is not None and read_path == "auto":
        dtype = str(storage.dtype).removeprefix("torch.")
        group = num_heads // storage.num_kv_heads if num_heads else 0
        if not group or not kernels.decode_supported(dtype, group, storage.head_dim):
            kernels = None
    if kernels is not None:
        return kernels
    if read_path == "paged":
        raise ValueError(
            "read path 'paged' needs the CPU kernels on a CPU, float32 or bfloat16 pages and a "
            "head dim of 16, 32, 64, 128 or 256 with at most 8 query heads per KV head"
        )
    return None


def _long(values: Sequence[int] | np.ndarray) -> Tensor:
    """A host int64 tensor of `values`, built through numpy (one conversion, no torch dispatch)."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))
