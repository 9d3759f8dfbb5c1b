"""Page slots in host memory: the tier right below the device pool.

Slots live in slabs of a fixed number of pages (`[slab_pages, layers, 2, page_size, kv_heads,
head_dim]`), so the tier grows and shrinks a slab at a time without copying what stays. With the
device pool on CUDA the slabs are pinned (page-locked), so device↔host copies run as DMA and are
issued without waiting (`non_blocking`); an event recorded after the last store is waited on
before the host reads a slot itself. On a CPU-only host the tier is a separate pool of host
memory, so stores and loads are real copies with real costs, as they are on a GPU node.
"""

from __future__ import annotations

import torch
from torch import Tensor

SLAB_BYTES = 64 << 20  # a slab is about this many bytes (at least one page)


class HostSlots:
    """`capacity` page slots in host memory, written and read by slot number."""

    name = "host"

    def __init__(
        self, capacity: int, page_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.page_shape = page_shape
        self.dtype = dtype
        self.device = device
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self.page_bytes = dtype.itemsize * int(torch.Size(page_shape).numel())
        self.slab_pages = max(1, SLAB_BYTES // self.page_bytes)
        self._slabs: list[Tensor] = []
        self._pending: torch.cuda.Event | None = None
        self.resize(capacity)

    @property
    def capacity(self) -> int:
        return len(self._slabs) * self.slab_pages

    @property
    def nbytes(self) -> int:
        return self.capacity * self.page_bytes

    def slabs_for(self, pages: int) -> int:
        return -(-pages // self.slab_pages)

    def resize(self, pages: int) -> None:
        """Hold room for `pages` slots (rounded up to whole slabs); slots above the new size
        must be empty (the index moves them first)."""
        want = self.slabs_for(pages)
        while len(self._slabs) > want:
            self._slabs.pop()
        while len(self._slabs) < want:
            shape = (self.slab_pages, *self.page_shape)
            self._slabs.append(torch.empty(shape, dtype=self.dtype, pin_memory=self.pinned))

    def write(self, slots: list[int], data: Tensor) -> None:
        """Store `data[i]` (on the pool's device) into slot `slots[i]`."""
        if self.pinned:
            for i, slot in enumerate(slots):
                slab, row = divmod(slot, self.slab_pages)
                self._slabs[slab][row].copy_(data[i], non_blocking=True)
            self._pending = torch.cuda.Event()
            self._pending.record()
            return
        for slab, rows, picks in self._by_slab(slots):
            self._slabs[slab].index_copy_(0, rows, data.index_select(0, picks))

    def read(self, slots: list[int], device: torch.device) -> Tensor:
        """Copies of the slots' pages on `device`, `[n, *page_shape]`."""
        out = torch.empty((len(slots), *self.page_shape), dtype=self.dtype, device=device)
        if device.type == "cuda":
            for i, slot in enumerate(slots):
                slab, row = divmod(slot, self.slab_pages)
                out[i].copy_(self._slabs[slab][row], non_blocking=self.pinned)
            return out
        self.settle()
        for slab, rows, picks in self._by_slab(slots):
            out.index_copy_(0, picks, self._slabs[slab].index_select(0, rows))
        return out

    def move(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slot `src` to slot `dst` for each pair (compaction before a shrink)."""
        self.settle()
        for src, dst in pairs:
            s_slab, s_row = divmod(src, self.slab_pages)
            d_slab, d_row = divmod(dst, self.slab_pages)
            self._slabs[d_slab][d_row].copy_(self._slabs[s_slab][s_row])

    def settle(self) -> None:
        """Wait for stores still in flight (before the host reads a slot itself)."""
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None

    def _by_slab(self, slots: list[int]) -> list[tuple[int, Tensor, Tensor]]:
        """Per slab: the rows in it and the positions in `slots` they came from."""
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for i, slot in enumerate(slots):
            slab, row = divmod(slot, self.slab_pages)
            rows, picks = groups.setdefault(slab, ([], []))
            rows.append(row)
            picks.append(i)
        return [
            (slab, torch.tensor(rows, dtype=torch.long), torch.tensor(picks, dtype=torch.long))
            for slab, (rows, picks) in groups.items()
        ]
