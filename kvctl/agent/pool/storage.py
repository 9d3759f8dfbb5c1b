"""The tensors behind the page pool: K/V contents of every page, in segments.

`PagePool` decides which page holds what; this module holds the bytes and applies the pool's
decisions to them (copy a page, write new tokens, read a batch's pages for attention).

Why segments: the pool must grow and shrink while the model runs. One big tensor could only be
resized by allocating a new one and copying everything (twice the memory at the worst moment), and
the caching allocator would keep the old block. A segment is `segment_pages` pages in one tensor
allocation of its own: growing allocates new segments at the top of the id space, shrinking
drops the top ones (after the defragmenter emptied them) and, on CUDA, returns their memory to the
driver. Page id `p` lives in segment `p // segment_pages`, row `p % segment_pages`.

Why this layout, per segment `[segment_pages, layers, 2, page_size, kv_heads, head_dim]` (page
major): the page is the unit the pool moves, so one page's K and V of every layer form one
contiguous block and `copy_pages` (defragmentation, copy-on-write) copies one row per page. The
model's per-layer reads stay efficient: the view `seg[:, layer, kv]` is `[segment_pages, page_size,
kv_heads, head_dim]` with the page as its only strided dimension, so each page's K (or V) of one
layer is still `page_size * kv_heads * head_dim` contiguous elements, which is what index_select,
index_put and paged-attention kernels (unit innermost stride, any page stride) need. A layer-major
layout (`[layers, 2, segment_pages, ...]`) cuts every page into `2 * layers` pieces instead, and
measured 1.4x slower page copies on CPU (gather + scatter of 64-page batches).

Segments start zeroed, never uninitialised: attention masks padding entries by weight, and a NaN
left in an unused page would survive a zero weight (0 * NaN = NaN).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from kvctl.agent.memory import release_free_memory

_STAGING_BYTES = {"cpu": 8 << 20, "cuda": 64 << 20}
"""Bytes of the staging buffer `copy_pages` goes through, per device type.

Allocated once with the storage, so that no copy allocates (on CPU a fresh multi-MiB buffer
page-faults at ~1 GB/s) and a defragmentation, which often runs when memory is tight, needs no
memory beyond it. Large enough that a batch of pages is a handful of operations.
"""
_DIRECT_RUN_BYTES = {"cpu": 64 << 10, "cuda": 16 << 20}
"""Smallest destination run `copy_pages` copies with an operation of its own, per device type.

Such a run costs one operation and one pass over its bytes; through the staging buffer it costs a
share of two operations and two passes. Below the bytes one pass moves during an operation's fixed
cost, the second pass is cheaper than the extra operation: ~40 KB on CPU (~2 us per numpy
operation at ~20 GB/s; 64 KiB to 256 KiB measured alike, 1 MiB 5-10% slower), ~15 MB on a GPU
(~5 us of launch at ~3 TB/s; an estimate, not yet measured on a GPU).
"""
_PARALLEL_RUN_BYTES = 512 << 10
"""Smallest direct run `copy_pages` hands to torch on CPU, when torch has a core to spare;
shorter runs, and every run when it has not, are copied by numpy on the calling thread.

torch splits a gather between its threads, each split a fork and a join. Below ~512 KiB the
split saves less than it costs (measured with 2 threads: 1.2x faster at 512 KiB, slower below).
And the join waits for the slowest thread: when torch has as many threads as there are cores,
any other runnable thread (another process, the agent's own server) deschedules a worker, and
each gather then waits a scheduler slice, 8-16 ms, whatever its size. A defragmentation issues
tens of gathers, a plain copy one: with 2 threads on 2 busy cores a 65 MiB defragmentation's
copies took ~300 ms instead of ~3. numpy never forks: one core's bandwidth, no stall, and a third
of torch's fixed cost per operation.
"""
_DIRECT_GATHER_BYTES = 16 << 10
"""Shortest stretch of a decode batch's pages in one segment (bytes of one layer's K) that
`gather_batch` gathers straight into place; shorter ones go through a staging area and a second
copy. An operation costs ~2.5 us on CPU, the time a core copies ~20 KB: below that the second
copy of a few pages is cheaper than an operation of their own."""
try:
    _CORES = len(os.sched_getaffinity(0))
except AttributeError:  # not on Linux
    _CORES = os.cpu_count() or 1


@dataclass(frozen=True)
class PageIndex:
    """Page ids of a batch, already split by segment, to gather every layer without regrouping.

    `groups` holds `(segment, rows)`: the rows (ids local to that segment) of the batch's pages
    in that segment, segment after segment; `restore` maps that order back to the caller's
    flattened `[B * P]` order (None when there is one segment and nothing to reorder).
    """

    shape: tuple[int, int]  # [B, P]
    groups: tuple[tuple[int, torch.Tensor], ...]
    restore: torch.Tensor | None


@dataclass(frozen=True)
class BatchIndex:
    """A padded batch of page tables (`[B, P]`) planned to be gathered in place, without the
    second pass over K/V that `PageIndex`'s reorder costs.

    The flattened pages are cut where the segment changes: each stretch of at least
    `_DIRECT_GATHER_BYTES` (per layer, K or V) is one gather straight into its place in the
    output (`direct`: `(segment, start, end, rows)`); the pages of shorter stretches are
    gathered by segment into the `staged` pages that follow the output in the buffer
    (`(segment, start, end, rows)`, relative to that staging area), then copied to their
    places `scatter` in one indexed copy.
    """

    shape: tuple[int, int]  # [B, P]
    direct: tuple[tuple[int, int, int, torch.Tensor], ...]
    staged: tuple[tuple[int, int, int, torch.Tensor], ...]
    scatter: torch.Tensor | None  # [staged pages], output positions
    scatter_host: np.ndarray | None  # the same on the host, for numpy's row copy on a CPU

    @property
    def buffer_pages(self) -> int:
        """Pages the `out` buffers of `gather_batch` must hold: the output and the staging."""
        staged = self.scatter.numel() if self.scatter is not None else 0
        return self.shape[0] * self.shape[1] + staged


@dataclass(frozen=True)
class SlotIndex:
    """Where a step's new tokens go, as rows of each segment's flat `[rows, kvh, hd]` view.

    `rows[layer, i]` is the row of entry i of `source`: the K and V of the step's tokens
    concatenated (`[2T]`), reordered by `source` when it is not None so that each segment's
    entries are one slice. `groups` holds `(segment, start, end)`: one `index_copy_` per
    segment and layer writes both K and V.
    """

    groups: tuple[tuple[int, int, int], ...]
    rows: torch.Tensor  # [layers, 2T]
    source: torch.Tensor | None  # [2T] into cat(k, v)


class KVStorage:
    """K/V contents of `num_segments * segment_pages` pages, one tensor per segment."""

    def __init__(
        self,
        num_segments: int,
        segment_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        staging_bytes: int | None = None,
        direct_run_bytes: int | None = None,
        parallel_run_bytes: int | None = None,
        direct_gather_bytes: int = _DIRECT_GATHER_BYTES,
    ) -> None:
        for name, value in (
            ("num_segments", num_segments),
            ("segment_pages", segment_pages),
            ("page_size", page_size),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.segment_pages = segment_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._dtype = dtype
        self._device = torch.device(device)
        self._segments: list[torch.Tensor] = []  # each [segment_pages, layers, 2, ps, kvh, hd]
        # per segment, views made once (a view costs ~1 us of dispatch, and a step takes
        # several per layer): per layer (K, V) `[sp, ps, kvh, hd]`, and the flat token rows
        self._layer_views: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._flat: list[torch.Tensor] = []
        self._parked = 0  # segments a sleeping model's storage released (`park`)
        self.add_segments(num_segments)
        self._device = self._segments[0].device  # "cuda" -> "cuda:0"
        kind = self._device.type if self._device.type in _STAGING_BYTES else "cpu"
        if staging_bytes is None:
            staging_bytes = _STAGING_BYTES[kind]
        if direct_run_bytes is None:
            direct_run_bytes = _DIRECT_RUN_BYTES[kind]
        staging_pages = max(1, staging_bytes // self.bytes_per_page)
        self._direct_run_pages = max(1, -(-direct_run_bytes // self.bytes_per_page))
        self._numpy_copies = self._device.type == "cpu"  # numpy sees host memory only
        layer_page_bytes = page_size * num_kv_heads * head_dim * dtype.itemsize
        self._direct_gather_pages = max(1, -(-direct_gather_bytes // layer_page_bytes))
        self._parallel_run_bytes = parallel_run_bytes  # None: as torch's threads allow
        self._staging = torch.empty(  # [staging_pages, page elements]
            staging_pages, self._page_elements, dtype=dtype, device=self._device
        )

    # ---- shape and size -----------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    @property
    def segments(self) -> list[torch.Tensor]:
        """The segment tensors, lowest ids first, for kernels that read pages where they lie
        (the list changes on resize: read it afresh at every step)."""
        return self._segments

    @property
    def num_pages(self) -> int:
        return len(self._segments) * self.segment_pages

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page: K and V of `page_size` tokens in every layer."""
        return self.page_bytes(
            self.page_size, self.num_layers, self.num_kv_heads, self.head_dim, self._dtype
        )

    @staticmethod
    def page_bytes(
        page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """`bytes_per_page` of such a storage, before building it (to size a pool in bytes)."""
        return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes held by the pages (the staging buffer of `copy_pages` not included)."""
        return self.num_pages * self.bytes_per_page

    @property
    def _page_elements(self) -> int:
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim

    @property
    def _page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    # ---- resizing -----------------------------------------------------------------------

    def add_segments(self, count: int) -> None:
        """Allocate `count` zeroed segments at the top; if one allocation fails, none is added."""
        if count < 0:
            raise ValueError(f"cannot add {count} segments")
        shape = (self.segment_pages, *self._page_shape)
        new = [torch.zeros(shape, dtype=self._dtype, device=self._device) for _ in range(count)]
        self._segments.extend(new)
        for seg in new:
            self._layer_views.append([(seg[:, i, 0], seg[:, i, 1]) for i in range(self.num_layers)])
            self._flat.append(seg.view(-1, self.num_kv_heads, self.head_dim))

    def release_segments(self, count: int) -> None:
        """Free the top `count` segments (their pages must already be empty in the pool).

        At least one segment always remains. On CUDA the memory goes back to the driver, not just
        to torch's caching allocator, so other processes on the GPU can use it. On the CPU a
        segment below malloc's mmap threshold lives in the heap, which keeps it resident after
        the free (glibc raises the threshold up to 32 MiB as large blocks are freed: importing
        torch does), so the heap is trimmed too; mmapped segments are unmapped by the free.
        """
        if count < 0 or count >= len(self._segments):
            raise ValueError(
                f"cannot release {count} of {len(self._segments)} segments; "
                "release at most all but one"
            )
        if count == 0:
            return
        del self._segments[-count:]
        del self._layer_views[-count:]
        del self._flat[-count:]
        self._release_to_device()

    # ---- sleeping -----------------------------------------------------------------------

    @property
    def parked(self) -> int:
        """Segments `park` released (0 while the storage holds its pages)."""
        return self._parked

    def park(self) -> int:
        """Free every segment, the last one too, for a model put to sleep (its pool must hold
        no page: nothing reads or writes the storage until `unpark`); the segments freed."""
        if self._parked:
            return 0
        count = len(self._segments)
        self._segments.clear()
        self._layer_views.clear()
        self._flat.clear()
        self._parked = count
        self._release_to_device()
        return count

    def unpark(self) -> None:
        """Allocate again the segments `park` freed, zeroed; if the allocation fails the storage
        stays parked."""
        if self._parked:
            self.add_segments(self._parked)
            self._parked = 0

    def _release_to_device(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        elif self._device.type == "cpu":
            release_free_memory()

    # ---- moving whole pages -------------------------------------------------------------

    def copy_pages(self, src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray) -> None:
        """Copy pages `src[i]` to `dst[i]` (every layer, K and V) in a few batched operations.

        Destinations must be distinct and disjoint from the sources (the pool only ever copies
        into free pages), so no copy can overwrite a page another copy still has to read, and the
        copies may run in any order.

        A run of consecutive destination pages of at least `direct_run_bytes` is one gather
        straight from its sources into the run (one pass over the bytes, like a plain copy);
        defragmentation fills holes lowest first, so its destinations come in such runs. The
        rest, grouped by (source segment, destination segment), goes through the staging buffer:
        one gather and one scatter per buffer-full (two passes, but few operations). On CPU,
        staged groups, runs shorter than `parallel_run_bytes` and, unless torch has a core to
        spare, every run are copied by numpy on the calling thread (see `_PARALLEL_RUN_BYTES`).
        Checks and planning are vectorised and every operation's index comes from one array
        moved to the device at once, so the host work per batch grows with the number of runs,
        not of pages.
        """
        src_ids, dst_ids = self._check_copy(src, dst)
        if not dst_ids.size:
            return
        plan = _plan_copy(
            src_ids, dst_ids, self.segment_pages, len(self._segments), self._direct_run_pages
        )
        host = self._numpy_copies
        index = torch.from_numpy(plan.index) if host else self._index_to_device(plan.index)
        numpy_below = self._numpy_run_pages() if host else 0
        rows = _Rows(self)
        for s, d, src_lo, src_span, dst_lo, start, end in plan.direct:
            if end - start < numpy_below:
                rows.host(s)[src_lo : src_lo + src_span].take(
                    plan.index[start:end],
                    axis=0,
                    out=rows.host(d)[dst_lo : dst_lo + end - start],
                    mode="clip",  # ids are checked; "raise" would copy through a buffer
                )
            else:
                torch.index_select(
                    rows.tensor(s).narrow(0, src_lo, src_span),
                    0,
                    index[start:end],
                    out=rows.tensor(d).narrow(0, dst_lo, end - start),
                )
        for s, d, start, end, dst_start in plan.staged:
            dst_end = dst_start + end - start
            if host:
                self._copy_staged_host(
                    rows, s, plan.index[start:end], d, plan.index[dst_start:dst_end]
                )
            else:
                self._copy_staged(rows, s, index[start:end], d, index[dst_start:dst_end])

    def _check_copy(
        self, src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Refuse copies the pool never asks for, before touching anything; return the ids as
        int64 arrays ordered by destination, the order `_plan_copy` finds runs in.

        All checks are a few vectorised passes whatever the batch size. Destinations that
        already ascend (a defragmentation's) are distinct by that test alone and are not sorted.
        """
        src_ids = np.asarray(src, dtype=np.int64)
        dst_ids = np.asarray(dst, dtype=np.int64)
        if src_ids.size != dst_ids.size:
            raise ValueError(f"copy_pages: {src_ids.size} sources but {dst_ids.size} destinations")
        count = dst_ids.size
        if not count:
            return src_ids, dst_ids
        # as unsigned, a negative id is beyond every pool: one max checks both ends
        if int(np.concatenate((src_ids, dst_ids)).view(np.uint64).max()) >= self.num_pages:
            raise IndexError(f"copy_pages: page ids must be in [0, {self.num_pages})")
        if count > 1 and not (dst_ids[1:] > dst_ids[:-1]).all():
            order = np.argsort(dst_ids, kind="stable")
            src_ids, dst_ids = src_ids[order], dst_ids[order]
            if not (dst_ids[1:] > dst_ids[:-1]).all():
                raise ValueError("copy_pages: destinations must be distinct")
        at = np.minimum(np.searchsorted(dst_ids, src_ids), count - 1)
        if (dst_ids[at] == src_ids).any():
            raise ValueError("copy_pages: destinations must not be among the sources")
        return src_ids, dst_ids

    def _numpy_run_pages(self) -> int:
        """Direct runs shorter than this many pages are copied by numpy (see
        `_PARALLEL_RUN_BYTES`); read per call, since torch's thread count can change."""
        if self._parallel_run_bytes is not None:
            return -(-self._parallel_run_bytes // self.bytes_per_page)
        if 1 < torch.get_num_threads() < _CORES:
            return -(-_PARALLEL_RUN_BYTES // self.bytes_per_page)
        return sys.maxsize

    def _rows(self, segment: int) -> torch.Tensor:
        return self._segments[segment].view(self.segment_pages, -1)  # [sp, page elements]

    def _index_to_device(self, index: np.ndarray) -> torch.Tensor:
        """Every row index of one `copy_pages` call in a single transfer. On CUDA it goes through
        pinned memory without blocking: a pageable copy would wait for the stream to drain, so
        planning the next batch could not overlap this batch's copies."""
        host = torch.from_numpy(index)
        if self._device.type == "cuda":
            return host.pin_memory().to(self._device, non_blocking=True)
        return host.to(self._device)

    def _copy_staged(
        self, rows: _Rows, src_seg: int, src: torch.Tensor, dst_seg: int, dst: torch.Tensor
    ) -> None:
        """Copy rows `src` of one segment to rows `dst` of another (or the same) one."""
        source, target = rows.tensor(src_seg), rows.tensor(dst_seg)
        step = self._staging.shape[0]
        for start in range(0, src.numel(), step):
            part = src[start : start + step]
            staged = self._staging[: part.numel()]
            torch.index_select(source, 0, part, out=staged)
            target.index_copy_(0, dst[start : start + step], staged)

    def _copy_staged_host(
        self, rows: _Rows, src_seg: int, src: np.ndarray, dst_seg: int, dst: np.ndarray
    ) -> None:
        """`_copy_staged` on CPU, with numpy: torch's CPU `index_copy_` moves one element at a
        time (3-4x slower than a gather of the same rows), numpy's fancy assignment whole rows."""
        source, target, staging = rows.host(src_seg), rows.host(dst_seg), rows.staging
        step = staging.shape[0]
        for start in range(0, src.size, step):
            part = src[start : start + step]
            staged = staging[: part.size]
            source.take(part, axis=0, out=staged, mode="clip")
            target[dst[start : start + step]] = staged

    # ---- the model's reads and writes ---------------------------------------------------

    def index_slots(self, slots_page: torch.Tensor, slots_offset: torch.Tensor) -> SlotIndex:
        """Turn token slots (page, offset) into rows to `write` every layer without regrouping.

        Ids given on the host (as the runtime gives them) are range-checked and grouped there
        with numpy, then moved: building the index never waits for the device. Ids already on
        the device are trusted, since checking them would stall the stream.
        """
        page, offset = slots_page.to(torch.long), slots_offset.to(torch.long)
        if page.device.type == "cpu" and offset.device.type == "cpu":
            return self._index_slots_host(page.numpy(), offset.numpy())
        sp, per_page = self.segment_pages, self.rows_per_page
        base = (page % sp) * per_page + offset
        layer = torch.arange(self.num_layers, device=page.device)[:, None] * (2 * self.page_size)
        kv = torch.cat((base, base + self.page_size))  # [2T]: the K rows, then the V rows
        by_segment = _group(torch.cat((page, page)) // sp, len(self._segments))
        source = torch.cat([pos for _, pos in by_segment])
        bounds = np.cumsum([0] + [pos.numel() for _, pos in by_segment]).tolist()
        groups = tuple(
            (s, a, b) for (s, _), (a, b) in zip(by_segment, pairwise(bounds), strict=True)
        )
        rows = (kv[source][None, :] + layer).to(self._device)
        return SlotIndex(groups, rows, source.to(self._device))

    def _index_slots_host(self, page: np.ndarray, offset: np.ndarray) -> SlotIndex:
        if page.size:
            if int(page.view(np.uint64).max()) >= self.num_pages:  # as unsigned: both ends
                raise IndexError(
                    f"page ids must be in [0, {self.num_pages}), got {page.min()}..{page.max()}"
                )
            if int(offset.view(np.uint64).max()) >= self.page_size:
                raise IndexError(f"slot offsets must be in [0, {self.page_size})")
        segment, row = np.divmod(page, self.segment_pages)
        base = row * self.rows_per_page + offset
        kv = np.concatenate((base, base + self.page_size))  # the K rows, then the V rows
        layer = np.arange(self.num_layers)[:, None] * (2 * self.page_size)
        to_device = self._to_device
        count = kv.size
        if not page.size or segment.min() == segment.max():
            first = int(segment[0]) if page.size else 0
            rows = torch.from_numpy(kv[None, :] + layer)
            return SlotIndex(((first, 0, count),), to_device(rows), None)
        keys = np.concatenate((segment, segment))
        source = np.argsort(keys, kind="stable")
        keys = keys[source]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        bounds = [*starts.tolist(), count]
        groups = tuple((int(keys[a]), a, b) for a, b in pairwise(bounds))
        rows = torch.from_numpy(kv[source][None, :] + layer)
        return SlotIndex(groups, to_device(rows), to_device(torch.from_numpy(source)))

    def write(
        self,
        layer: int,
        slots_page: torch.Tensor | SlotIndex,
        slots_offset: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store new tokens' K and V (`[T, kv_heads, head_dim]`) at slots (page, offset).

        Pass the slots as two `[T]` id tensors, or as `index_slots(...)` with `slots_offset`
        None. With several segments the grouping reads segment counts back to the host, which
        on CUDA is a synchronisation: group once per step with `index_slots`, not per layer.
        One `index_copy_` per segment writes K and V together.
        """
        if isinstance(slots_page, SlotIndex):
            index = slots_page
        else:
            if slots_offset is None:
                raise ValueError("write: slots_offset is required with a page id tensor")
            index = self.index_slots(slots_page, slots_offset)
        kv = torch.cat((k, v)).to(self._dtype)  # [2T, kvh, hd]
        if index.source is not None:
            kv = kv.index_select(0, index.source)
        rows = index.rows[layer]
        for s, start, end in index.groups:
            self._flat[s].index_copy_(0, rows[start:end], kv[start:end])

    def index_pages(self, page_ids: torch.Tensor) -> PageIndex:
        """Split a batch's page ids (`[B, P]`) by segment once, to `gather` every layer.

        Like `index_slots`: host ids are checked and grouped on the host, device ids trusted.
        """
        if page_ids.dim() != 2:
            raise ValueError(f"page_ids must be [batch, pages], got shape {tuple(page_ids.shape)}")
        shape = (page_ids.shape[0], page_ids.shape[1])
        flat = page_ids.to(torch.long).reshape(-1)
        self._check_page_range(flat)
        to_device = self._to_device
        if len(self._segments) == 1:
            return PageIndex(shape, ((0, to_device(flat)),), None)
        by_segment = _group(flat // self.segment_pages, len(self._segments))
        groups = tuple((s, to_device(flat[pos] - s * self.segment_pages)) for s, pos in by_segment)
        order = torch.cat([pos for _, pos in by_segment]) if by_segment else flat
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.numel(), device=order.device)
        return PageIndex(shape, groups, to_device(restore))

    def index_batch(self, padded: np.ndarray) -> BatchIndex:
        """Plan `gather_batch` of a padded batch of page tables (`[B, P]` host int64 ids).

        Host work only: a few numpy passes and one transfer of row ids to the device.
        """
        batch, width = padded.shape
        if padded.size and int(padded.view(np.uint64).max()) >= self.num_pages:
            raise IndexError(
                f"page ids must be in [0, {self.num_pages}), got {padded.min()}..{padded.max()}"
            )
        to_device = self._to_device
        flat = padded.reshape(-1)
        count = flat.size
        if len(self._segments) == 1 or not count:
            whole = ((0, 0, count, to_device(torch.from_numpy(flat))),)
            return BatchIndex((batch, width), whole, (), None, None)
        segment, local = np.divmod(flat, self.segment_pages)
        starts = np.flatnonzero(np.r_[True, segment[1:] != segment[:-1]])
        ends = np.r_[starts[1:], count]
        long = (ends - starts) >= self._direct_gather_pages
        if long.all():
            rows = to_device(torch.from_numpy(local))
            direct = tuple(
                (int(segment[a]), a, b, rows[a:b])
                for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
            )
            return BatchIndex((batch, width), direct, (), None, None)
        short = ~np.repeat(long, ends - starts)
        positions = np.flatnonzero(short)
        order = np.argsort(segment[positions], kind="stable")
        positions = positions[order]  # the staged pages, by segment
        staged_segments = segment[positions]
        bounds = np.flatnonzero(np.r_[True, staged_segments[1:] != staged_segments[:-1]])
        bounds_end = np.r_[bounds[1:], positions.size]
        rows = to_device(torch.from_numpy(np.concatenate((local, local[positions]))))
        direct = tuple(
            (int(segment[a]), a, b, rows[a:b])
            for a, b in zip(starts[long].tolist(), ends[long].tolist(), strict=True)
        )
        staged = tuple(
            (int(staged_segments[a]), a, b, rows[count + a : count + b])
            for a, b in zip(bounds.tolist(), bounds_end.tolist(), strict=True)
        )
        scatter = to_device(torch.from_numpy(positions))
        return BatchIndex((batch, width), direct, staged, scatter, positions)

    def gather_batch(
        self, layer: int, index: BatchIndex, out: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`gather` of an `index_batch` plan: K, V `[B, P * page_size, kvh, hd]`, views of
        `out` (two contiguous tensors of at least `index.buffer_pages` pages)."""
        batch, pages = index.shape
        count = batch * pages
        views = self._layer_views
        out_k, out_v = out
        for s, start, end, rows in index.direct:
            seg_k, seg_v = views[s][layer]
            torch.index_select(seg_k, 0, rows, out=out_k[start:end])
            torch.index_select(seg_v, 0, rows, out=out_v[start:end])
        if index.scatter is not None:
            for s, start, end, rows in index.staged:
                seg_k, seg_v = views[s][layer]
                torch.index_select(seg_k, 0, rows, out=out_k[count + start : count + end])
                torch.index_select(seg_v, 0, rows, out=out_v[count + start : count + end])
            staged = index.scatter.numel()
            for buffer in (out_k, out_v):
                if self._numpy_copies:  # numpy copies whole rows; torch's CPU index_copy_
                    # moves one element at a time (5x slower here)
                    flat = buffer[: count + staged].view(count + staged, -1)
                    host = flat.view(torch.uint8).numpy()
                    host[index.scatter_host] = host[count : count + staged]
                else:
                    buffer.index_copy_(0, index.scatter, buffer[count : count + staged])
        shape = (batch, pages * self.page_size, self.num_kv_heads, self.head_dim)
        return out_k[:count].view(shape), out_v[:count].view(shape)

    def _check_page_range(self, ids: torch.Tensor) -> None:
        """IndexError for a host id outside the pool: on CUDA a bad id in an index kernel is a
        device-side assert that poisons the whole context, not an exception."""
        if ids.device.type != "cpu" or not ids.numel():
            return
        host = ids.numpy()  # a view; numpy's min/max cost a fraction of torch's small-op dispatch
        low, high = int(host.min()), int(host.max())
        if low < 0 or high >= self.num_pages:
            raise IndexError(f"page ids must be in [0, {self.num_pages}), got {low}..{high}")

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self._device)

    def gather(
        self,
        layer: int,
        page_ids: torch.Tensor | PageIndex,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read whole pages of one layer: `page_ids` `[B, P]` -> K, V `[B, P * page_size, kvh, hd]`.

        Every entry must be a valid page id; padding entries may repeat any page (e.g. 0) and the
        caller masks them. Pass `index_pages(...)` to reuse one grouping across layers, and `out`
        (two contiguous tensors of at least `B * P` pages) to reuse one buffer across layers and
        steps: the result is then a view of it, valid until the buffer's next use.
        """
        index = page_ids if isinstance(page_ids, PageIndex) else self.index_pages(page_ids)
        batch, pages = index.shape
        count = batch * pages
        if out is None:
            out = self.gather_buffers(count)
        out_k, out_v = out[0][:count], out[1][:count]
        self._gather_into(layer, index, out_k, out_v)
        out_shape = (batch, pages * self.page_size, self.num_kv_heads, self.head_dim)
        return out_k.view(out_shape), out_v.view(out_shape)

    def _gather_into(
        self, layer: int, index: PageIndex, out_k: torch.Tensor, out_v: torch.Tensor
    ) -> None:
        staged_k, staged_v = out_k, out_v
        if index.restore is not None:  # several segments: gather by segment, then reorder
            staged_k, staged_v = torch.empty_like(out_k), torch.empty_like(out_v)
        start = 0
        for s, rows in index.groups:
            seg_k, seg_v = self._layer_views[s][layer]
            end = start + rows.numel()
            torch.index_select(seg_k, 0, rows, out=staged_k[start:end])
            torch.index_select(seg_v, 0, rows, out=staged_v[start:end])
            start = end
        if index.restore is not None:
            torch.index_select(staged_k, 0, index.restore, out=out_k)
            torch.index_select(staged_v, 0, index.restore, out=out_v)

    def gather_buffers(self, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two uninitialised `[pages, page_size, kvh, hd]` tensors, K and V, for `gather`'s out."""
        shape = (pages, self.page_size, self.num_kv_heads, self.head_dim)
        return (
            torch.empty(shape, dtype=self._dtype, device=self._device),
            torch.empty(shape, dtype=self._dtype, device=self._device),
        )

    # ---- reading in place ---------------------------------------------------------------

    def run_of(self, pages: Sequence[int]) -> tuple[int, int] | None:
        """`(segment, first row)` when `pages` are one run of consecutive ids in one segment.

        Decided from the ids alone (`pages[i] == pages[0] + i`, first and last page in the same
        segment), never from a pool flag: a view is only right if the ids say so. A run that
        crosses a segment boundary lies in two tensors, so no single view can hold it: None.
        """
        count = len(pages)
        if not count:
            return None
        first = int(pages[0])
        if not 0 <= first < self.num_pages:
            raise IndexError(f"page ids must be in [0, {self.num_pages}), got {first}")
        last = first + count - 1
        segment, row = divmod(first, self.segment_pages)
        if last // self.segment_pages != segment or int(pages[-1]) != last:
            return None
        if count > 2 and list(pages) != list(range(first, last + 1)):
            return None
        return segment, row

    def pages_view(
        self, layer: int, segment: int, row: int, count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `count` consecutive pages of one segment, `[count, page_size, kvh, hd]`
        each: views of storage, no copy (valid until the pages move or the segment is dropped).

        Each page's tokens are contiguous, but pages are `layers * 2` pages' worth of elements
        apart (the storage is page-major), so a run of several pages is not one flat
        `[tokens, kvh, hd]` tensor: attention that needs one still copies it.
        """
        if count < 1 or row < 0 or row + count > self.segment_pages:
            raise IndexError(f"rows {row}..{row + count - 1} are not in a segment's pages")
        seg = self._segments[segment].narrow(0, row, count)
        return seg[:, layer, 0], seg[:, layer, 1]

    def read_sequence(self, layer: int, pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's K and V of one layer by its page table, `[n, page_size, kvh, hd]` each.

        A run (see `run_of`) is a view of storage; any other table is gathered into new tensors.
        Either way element `[i, t]` is token `t` of page `pages[i]`.
        """
        run = self.run_of(pages)
        if run is not None:
            return self.pages_view(layer, run[0], run[1], len(pages))
        shape = (len(pages), self.page_size, self.num_kv_heads, self.head_dim)
        if not len(pages):
            empty = torch.empty(shape, dtype=self._dtype, device=self._device)
            return empty, empty.clone()
        ids = torch.from_numpy(np.asarray(pages, dtype=np.int64)).view(1, -1)
        keys, values = self.gather(layer, ids)
        return keys.view(shape), values.view(shape)

    @property
    def rows_per_page(self) -> int:
        """Rows of `token_rows` from one page to the next: `layers * 2 * page_size`."""
        return self.num_layers * 2 * self.page_size

    def token_rows(self, segment: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A segment's K and V of one layer as token rows for kernels that read through a page
        table: two views `[rows, kvh, hd]`, no copy.

        Token `t` of the page at row `r` of the segment is row `r * rows_per_page + t` of both
        (the V view starts `page_size` rows after the K view, so one row index serves both).
        Rows in between belong to other layers and must never be read: a kernel reads only the
        `page_size` rows from `r * rows_per_page` of the pages in its table.
        """
        flat = self._segments[segment].view(-1, self.num_kv_heads, self.head_dim)
        rows = (self.segment_pages - 1) * self.rows_per_page + self.page_size
        start = layer * 2 * self.page_size
        return flat.narrow(0, start, rows), flat.narrow(0, start + self.page_size, rows)

    # ---- whole-page helpers (tests, diagnostics) ----------------------------------------

    def read_pages(self, page_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Copies of whole pages: `[n, layers, 2, page_size, kv_heads, head_dim]`.

        One row copy per page: torch's CPU index_put / index_copy move an element at a time,
        and a page is tens of KiB to MiBs (the tiers store and load through here)."""
        ids = _page_list(page_ids)
        out = torch.empty((len(ids), *self._page_shape), dtype=self._dtype, device=self._device)
        per = self.segment_pages
        for i, page in enumerate(ids):
            out[i].copy_(self._segments[page // per][page % per])
        return out

    def fill_pages(
        self, page_ids: Sequence[int] | torch.Tensor, values: torch.Tensor | float
    ) -> None:
        """Set whole pages to `values`, broadcast to `[n, layers, 2, page_size, kvh, hd]`."""
        ids = _page_list(page_ids)
        full = (len(ids), *self._page_shape)
        vals = torch.as_tensor(values, dtype=self._dtype, device=self._device).expand(full)
        per = self.segment_pages
        for i, page in enumerate(ids):
            self._segments[page // per][page % per].copy_(vals[i])


def _page_list(page_ids: Sequence[int] | torch.Tensor) -> list[int]:
    """Page ids as Python ints, checked against nothing (callers pass pages they own)."""
    if isinstance(page_ids, torch.Tensor):
        return [int(p) for p in page_ids.reshape(-1).tolist()]
    return [int(p) for p in page_ids]


def _group(keys: torch.Tensor, num_keys: int) -> list[tuple[int, torch.Tensor]]:
    """Positions of each distinct key in `keys` (`[n]`, values in `[0, num_keys)`), by key.

    One sort and one count, whatever the number of keys; reading the counts back to the host is
    the only synchronisation.
    """
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=num_keys).tolist()
    if len(counts) > num_keys:
        raise IndexError(f"page id beyond the pool (segment {len(counts) - 1} of {num_keys})")
    return [(key, pos) for key, pos in enumerate(torch.split(order, counts)) if pos.numel()]


class _Rows:
    """The segments of one `copy_pages` call as `[segment_pages, page elements]` tensors and, on
    CPU, as numpy `[segment_pages, page bytes]` arrays (bytes: numpy has no bfloat16), each
    view made once per call, however many operations use it."""

    def __init__(self, storage: KVStorage) -> None:
        self._storage = storage
        self._tensors: dict[int, torch.Tensor] = {}
        self._host: dict[int, np.ndarray] = {}

    def tensor(self, segment: int) -> torch.Tensor:
        view = self._tensors.get(segment)
        if view is None:
            view = self._tensors[segment] = self._storage._rows(segment)
        return view

    def host(self, segment: int) -> np.ndarray:
        view = self._host.get(segment)
        if view is None:
            view = self._host[segment] = self.tensor(segment).view(torch.uint8).numpy()
        return view

    @property
    def staging(self) -> np.ndarray:
        return self._storage._staging.view(torch.uint8).numpy()


@dataclass(frozen=True)
class _CopyPlan:
    """How `copy_pages` carries out one batch; every row is local to its segment.

    `index` holds every operation's rows in one array, so that they reach the device in one
    transfer: first the source rows of the direct runs, then the source rows of the staged
    groups, then their destination rows. A direct run is `(src segment, dst segment, src_lo,
    src_span, dst_lo, start, end)`: its sources, `index[start:end]` relative to `src_lo`, lie in
    `[src_lo, src_lo + src_span)` and it fills the destination rows `[dst_lo, dst_lo + end -
    start)`. A staged group is `(src segment, dst segment, start, end, dst_start)`: source rows
    `index[start:end]`, destination rows as many from `index[dst_start]`.
    """

    index: np.ndarray  # int64
    direct: list[tuple[int, int, int, int, int, int, int]]
    staged: list[tuple[int, int, int, int, int]]


def _plan_copy(
    src: np.ndarray, dst: np.ndarray, segment_pages: int, num_segments: int, direct_pages: int
) -> _CopyPlan:
    """Split copies (ordered by destination) into runs of consecutive destinations, vectorised.

    A run ends where the destinations stop being consecutive, or the source or destination
    segment changes. It is copied directly when it is long enough and its destination rows do
    not fall within the span of its source rows (torch refuses a gather whose input and output
    views overlap, even where no element is shared); everything else is staged.
    """
    count = dst.size
    src_seg, src_row = np.divmod(src, segment_pages)
    dst_seg, dst_row = np.divmod(dst, segment_pages)
    breaks = np.empty(count, dtype=bool)
    breaks[0] = True
    np.not_equal(dst[1:] - dst[:-1], 1, out=breaks[1:])
    breaks[1:] |= src_seg[1:] != src_seg[:-1]
    breaks[1:] |= dst_row[1:] == 0  # consecutive ids, but the next segment
    starts = breaks.nonzero()[0]
    lengths = np.empty_like(starts)
    np.subtract(starts[1:], starts[:-1], out=lengths[:-1])
    lengths[-1] = count - starts[-1]
    lo = np.minimum.reduceat(src_row, starts)
    hi = np.maximum.reduceat(src_row, starts)
    dst_lo, run_src, run_dst = dst_row[starts], src_seg[starts], dst_seg[starts]
    straddles = (run_src == run_dst) & (lo < dst_lo + lengths) & (dst_lo <= hi)
    is_direct = (lengths >= direct_pages) & ~straddles
    relative = src_row - np.repeat(lo, lengths)
    columns = (run_src, run_dst, lo, hi + 1 - lo, dst_lo)
    if is_direct.all():
        ends = np.cumsum(lengths)
        direct = list(zip(*(c.tolist() for c in (*columns, ends - lengths, ends)), strict=True))
        return _CopyPlan(relative, direct, [])
    direct_lengths = lengths[is_direct]
    ends = np.cumsum(direct_lengths)
    columns = (*(c[is_direct] for c in columns), ends - direct_lengths, ends)
    direct = list(zip(*(c.tolist() for c in columns), strict=True))
    by_page = np.repeat(is_direct, lengths)
    rest = ~by_page
    pair = src_seg[rest] * num_segments + dst_seg[rest]
    order = np.argsort(pair, kind="stable")
    pair = pair[order]
    bounds = np.concatenate(([0], (pair[1:] != pair[:-1]).nonzero()[0] + 1, [pair.size]))
    src_segs, dst_segs = np.divmod(pair[bounds[:-1]], num_segments)
    first = int(ends[-1]) if ends.size else 0  # where the staged rows start in `index`
    staged = [
        (s, d, first + a, first + b, first + pair.size + a)
        for s, d, a, b in zip(
            src_segs.tolist(),
            dst_segs.tolist(),
            bounds[:-1].tolist(),
            bounds[1:].tolist(),
            strict=True,
        )
    ]
    index = np.concatenate((relative[by_page], src_row[rest][order], dst_row[rest][order]))
    return _CopyPlan(index, direct, staged)
