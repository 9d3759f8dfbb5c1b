"""Attention that reads K/V where they lie in the page pool, instead of gathering them first.

Two readers, both numerically the attention of `attention.py`:

- `attend_pages`: one sequence's new tokens over its K/V given page by page (`[n, page_size,
  kvh, d]`), as `KVStorage.read_sequence` returns them: a view of storage when the pages are one
  run, a gathered copy otherwise. The pages are flattened into one `[tokens, kvh, d]` operand
  (the only copy of a run; none for a gathered table) and attended with their own head count.
- `PageTableAttention`: a decode batch through FlexAttention with a block-sparse mask built from
  the page tables, over `KVStorage.token_rows` (a zero-copy view of a whole segment). Nothing is
  gathered: the kernel reads each listed page's rows where they are. One FlexAttention call per
  segment the batch touches; a sequence whose pages lie in several segments cannot be read by
  one call and is left to the caller's gather path (`BlockPlan.rest`).

Why the decode reader needs a kernel and not views: storage is page-major, so one page's K of one
layer is contiguous but consecutive pages are `layers * 2` pages' worth of elements apart. A run
of pages is a view, yet not the single-stride `[tokens, kvh, d]` operand SDPA needs; SDPA over a
run would copy it, which is what the gather does. A page-table kernel has no such need.

FlexAttention is compiled on CUDA (one compilation per power-of-two batch bucket; the block table
has a fixed width, a segment's pages, so its size never recompiles). Elsewhere it runs eagerly,
which evaluates the mask on every row of the segment: exact, used by the tests on CPU, far too
slow to serve. Compiled, the mask is evaluated only on each sequence's last, partly filled page;
every other listed page is a full block. Eagerly, the mask alone must say which rows exist, so it
reads an owner table (`[batch, segment_pages]`) that the compiled path never builds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvctl.agent.model.attention import FULL, LayerAttention, attend_one
from kvctl.agent.pool.storage import KVStorage

Q_BLOCK = 128
"""FlexAttention's query block: a decode query (one row) fits in one, and 128 is a multiple of
every query tile its kernels use."""


def attend_pages(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    cached_len: int,
    mask: Tensor | None = None,
    seen: LayerAttention = FULL,
) -> Tensor:
    """Causal attention of one sequence's t new tokens over K/V given page by page.

    q [t, h, d]; k_pages, v_pages [n, page_size, kvh, d] holding `cached_len + t` tokens in
    order, the new ones last (the rest of the last page is ignored); `mask` and `seen` as for
    `attend_one`. Returns [t, h, d], bit for bit what `attend_one` returns on the same tokens.
    """
    t, _, d = q.shape
    n, page_size, kvh, _ = k_pages.shape
    total = cached_len + t
    if total > n * page_size:
        raise ValueError(f"{n} pages of {page_size} cannot hold {total} tokens")
    keys = k_pages.reshape(n * page_size, kvh, d)[:total]
    values = v_pages.reshape(n * page_size, kvh, d)[:total]
    return attend_one(q, keys, values, cached_len, mask, seen)


def flex_available() -> bool:
    """Whether this torch has FlexAttention (and the block masks it needs)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class BlockTable:
    """The decode rows whose pages all lie in one segment, as a FlexAttention block mask over
    that segment's token rows.

    `rows` are batch rows in the order of the mask's batch (None: the whole batch, in order);
    `count` of the mask's rows are real, the rest pad the batch to a compiled bucket.
    """

    segment: int
    rows: Tensor | None
    count: int
    block_mask: object  # torch.nn.attention.flex_attention.BlockMask


@dataclass(frozen=True)
class BlockPlan:
    """One decode step's reads: a block table per segment, and the batch rows left to gather
    (their pages lie in more than one segment)."""

    tables: tuple[BlockTable, ...]
    rest: tuple[int, ...]


class PageTableAttention:
    """Decode attention through FlexAttention over page tables; see the module docstring.

    `compiled` defaults to True on CUDA. Compiled, the batch is padded to a power of two and the
    block table is `table_width` blocks wide (default: a segment's pages on CUDA, every block of
    the segment elsewhere, which is what the CPU kernel insists on).
    """

    def __init__(self, storage: KVStorage, compiled: bool | None = None) -> None:
        if not flex_available():
            raise RuntimeError(
                "this torch has no FlexAttention (torch.nn.attention.flex_attention)"
            )
        self.storage = storage
        self.compiled = storage.device.type == "cuda" if compiled is None else compiled
        self._blocks_per_page = storage.rows_per_page // storage.page_size
        if not self.compiled:
            self._width = 0
        elif storage.device.type == "cuda":
            self._width = storage.segment_pages
        else:
            self._width = storage.segment_pages * self._blocks_per_page

    def plan(self, tables: Sequence[Sequence[int]], lengths: Sequence[int]) -> BlockPlan:
        """Block tables for a decode batch: sequence i holds `lengths[i]` tokens (the new one
        included) in the first pages of `tables[i]`."""
        sp = self.storage.segment_pages
        page_size = self.storage.page_size
        by_segment: dict[int, list[int]] = {}
        rest: list[int] = []
        for row, (pages, length) in enumerate(zip(tables, lengths, strict=True)):
            n = -(-length // page_size)
            if n < 1 or n > len(pages):
                raise ValueError(f"row {row}: {len(pages)} pages cannot hold {length} tokens")
            used = pages[:n]
            segment = used[0] // sp
            if min(used) // sp == segment == max(used) // sp:
                by_segment.setdefault(segment, []).append(row)
            else:
                rest.append(row)
        whole = len(by_segment) == 1 and not rest
        built = tuple(
            self._table(segment, rows, tables, lengths, whole)
            for segment, rows in sorted(by_segment.items())
        )
        return BlockPlan(built, tuple(rest))

    def _table(
        self,
        segment: int,
        rows: list[int],
        tables: Sequence[Sequence[int]],
        lengths: Sequence[int],
        whole: bool,
    ) -> BlockTable:
        storage = self.storage
        sp, page_size = storage.segment_pages, storage.page_size
        count = len(rows)
        padded = 1 << (count - 1).bit_length() if self.compiled else count
        needed = [-(-lengths[r] // page_size) for r in rows]
        width = self._width or max(needed)
        full = np.zeros((padded, width), dtype=np.int32)  # block of every full page, in order
        partial = np.zeros((padded, width), dtype=np.int32)  # block of the last page if partial
        full_counts = np.zeros(padded, dtype=np.int32)
        partial_counts = np.zeros(padded, dtype=np.int32)
        last_tokens = np.zeros(padded, dtype=np.int32)
        owner = None if self.compiled else np.full((padded, sp), -1, dtype=np.int32)
        base = segment * sp
        for i, (row, n) in enumerate(zip(rows, needed, strict=True)):
            local = np.asarray(tables[row][:n], dtype=np.int32) - base
            tail = lengths[row] - (n - 1) * page_size
            whole_pages = n if tail == page_size else n - 1
            full[i, :whole_pages] = local[:whole_pages] * self._blocks_per_page
            full_counts[i] = whole_pages
            if whole_pages < n:
                partial[i, 0] = local[-1] * self._blocks_per_page
                partial_counts[i] = 1
            last_tokens[i] = tail
            if owner is not None:
                owner[i, local] = np.arange(n, dtype=np.int32)
        host = [full, partial, full_counts, partial_counts, last_tokens]
        if owner is not None:
            host.append(owner)
        moved = _to_device(host, storage.device)
        full_t, partial_t, full_counts_t, partial_counts_t, last_t = moved[:5]
        if owner is None:
            mask_mod = _last_page_mask(last_t, page_size)
        else:
            lengths_t = torch.zeros(padded, dtype=torch.int32)
            lengths_t[:count] = torch.tensor([lengths[r] for r in rows], dtype=torch.int32)
            mask_mod = _owner_mask(moved[5], lengths_t.to(storage.device), storage)
        from torch.nn.attention.flex_attention import BlockMask

        block_mask = BlockMask.from_kv_blocks(
            partial_counts_t.view(padded, 1, 1),
            partial_t.view(padded, 1, 1, width),
            full_counts_t.view(padded, 1, 1),
            full_t.view(padded, 1, 1, width),
            BLOCK_SIZE=(Q_BLOCK, page_size),
            mask_mod=mask_mod,
            seq_lengths=(1, self._rows()),
            compute_q_blocks=False,
        )
        index = None
        if not whole:
            index = torch.tensor(rows, dtype=torch.long).to(storage.device)
        return BlockTable(segment, index, count, block_mask)

    def _rows(self) -> int:
        storage = self.storage
        return (storage.segment_pages - 1) * storage.rows_per_page + storage.page_size

    def attend(self, layer: int, q: Tensor, table: BlockTable) -> Tensor:
        """Decode attention of the table's rows of q ([B, h, d], the whole batch) over their
        pages of one layer; returns [table.count, h, d]."""
        h, d = q.shape[1:]
        rows = q if table.rows is None else q.index_select(0, table.rows)
        padded = table.block_mask.kv_num_blocks.shape[0]  # type: ignore[attr-defined]  # a BlockMask, typed object so flex_attention is imported only where used
        queries = rows.unsqueeze(2)  # [count, h, 1, d]
        if padded > table.count:
            queries = torch.cat([queries, queries.new_zeros(padded - table.count, h, 1, d)])
        keys, values = self.storage.token_rows(table.segment, layer)  # [S, kvh, d]
        out = _flex(self.compiled)(
            queries,
            keys.permute(1, 0, 2).unsqueeze(0),
            values.permute(1, 0, 2).unsqueeze(0),
            block_mask=table.block_mask,
            enable_gqa=True,
        )
        return out[: table.count, :, 0]


def _to_device(arrays: list[np.ndarray], device: torch.device) -> list[Tensor]:
    """Host int32 arrays on `device` in one transfer (pinned and asynchronous on CUDA)."""
    flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        flat = flat.to(device)
    pieces = flat.split([a.size for a in arrays])
    return [p.view(a.shape) for p, a in zip(pieces, arrays, strict=True)]


def _last_page_mask(last_tokens: Tensor, page_size: int) -> Callable[..., Tensor]:
    """The mask of a sequence's partly filled last page (the only block it is evaluated on)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx % page_size < last_tokens[b]

    return mask_mod


def _owner_mask(owner: Tensor, lengths: Tensor, storage: KVStorage) -> Callable[..., Tensor]:
    """The exact mask over every row of a segment: row r is token `r % rows_per_page` of the page
    at row `r // rows_per_page`, which must be in the sequence's table and below its length."""
    per_page, page_size = storage.rows_per_page, storage.page_size

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        offset = kv_idx % per_page
        logical = owner[b, kv_idx // per_page]
        return (offset < page_size) & (logical >= 0) & (logical * page_size + offset < lengths[b])

    return mask_mod


@functools.cache
def _flex(compiled: bool) -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    # one compilation per batch bucket (powers of two up to the largest batch)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    return torch.compile(flex_attention, dynamic=False)
