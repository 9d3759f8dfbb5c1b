"""Page slots in host memory: the tier right below the device pool.

Slots live in slabs of a fixed number of pages (`[slab_pages, layers, 2, page_size, kv_heads,
head_dim]`) and a last, smaller one for what is left, so the tier takes exactly its size and
grows and shrinks without copying more than that last slab. With the device pool on CUDA the
slabs are pinned (page-locked), so device↔host copies run as DMA and are issued without waiting
(`non_blocking`); an event recorded after the last copy either way is waited on before the host
reads or rewrites a slot itself (a demotion to disk, a compaction, a slab resize). On a CPU-only
host the tier is a separate pool of host memory, so stores and loads are real copies with real
costs, as they are on a GPU node.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

SLAB_BYTES = 64 << 20  # a slab is about this many bytes (at least one page)


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable); None where
    /proc/meminfo does not tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


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
        return sum(int(slab.shape[0]) for slab in self._slabs)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.page_bytes

    def resize(self, pages: int) -> None:
        """Hold room for exactly `pages` slots: whole slabs, then a last one as large as what
        is left (no more memory than the tier's size). Slots above the new size must be empty
        (the index moves them first); a last slab that changes size is copied."""
        full, rest = divmod(pages, self.slab_pages)
        sizes = [self.slab_pages] * full + ([rest] if rest else [])
        slabs = []
        for i, size in enumerate(sizes):
            old = self._slabs[i] if i < len(self._slabs) else None
            if old is not None and old.shape[0] == size:
                slabs.append(old)
                continue
            slab = torch.empty((size, *self.page_shape), dtype=self.dtype, pin_memory=self.pinned)
            if old is not None:
                self.settle()
                rows = min(size, int(old.shape[0]))
                slab[:rows].copy_(old[:rows])
            slabs.append(slab)
        self._slabs = slabs

    def write(self, slots: list[int], data: Tensor) -> None:
        """Store `data[i]` (on the pool's device) into slot `slots[i]`: a row copy per page
        (torch's CPU index_copy_ moves one element at a time); on CUDA issued without waiting."""
        for i, slot in enumerate(slots):
            self._row(slot).copy_(data[i], non_blocking=self.pinned)
        self._mark_copies()

    def read(self, slots: list[int], device: torch.device) -> Tensor:
        """Copies of the slots' pages on `device`, `[n, *page_shape]`."""
        out = torch.empty((len(slots), *self.page_shape), dtype=self.dtype, device=device)
        self.read_into(out, range(len(slots)), slots)
        return out

    def read_into(self, out: Tensor, rows: Sequence[int], slots: Sequence[int]) -> None:
        """Copy slot `slots[i]` into `out[rows[i]]` (on the host or the pool's device)."""
        if out.device.type != "cuda":
            self.settle()
        for row, slot in zip(rows, slots, strict=True):
            out[row].copy_(self._row(slot), non_blocking=self.pinned)
        if out.device.type == "cuda":
            self._mark_copies()

    def _mark_copies(self) -> None:
        """Note the copies just issued on the stream: the host waits for them before it
        touches a slot itself (`settle`)."""
        if self.pinned:
            self._pending = torch.cuda.Event()
            self._pending.record()

    def move(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slot `src` to slot `dst` for each pair (compaction before a shrink)."""
        self.settle()
        for src, dst in pairs:
            self._row(dst).copy_(self._row(src))

    def _row(self, slot: int) -> Tensor:
        slab, row = divmod(slot, self.slab_pages)
        return self._slabs[slab][row]

    def settle(self) -> None:
        """Wait for copies still in flight (before the host reads or rewrites a slot)."""
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None
