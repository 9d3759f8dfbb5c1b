"""Random pool histories, read back after every step through the in-place read paths.

Every token written gets distinct K and V tags in every layer. Sequences are allocated, grown
(copy-on-write included), forked, freed and moved by the defragmenter in random order; after
every step each live sequence must read back exactly its tokens' tags:

- through `KVStorage.read_sequence`, which must be a view of storage exactly when the page ids
  form one run inside one segment (decided here independently, from the ids), and a copy
  otherwise;
- through the block tables the page-table decode kernel reads (`PageTableAttention.plan`, the
  compiled layout), row by row from the segment's token rows, with the sequences whose pages
  span segments left to the gather and read that way.

A view taken from a stale page table, a block id off by a page, a layer or the K/V half, or a
run that crosses a segment boundary would read a wrong tag.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)
from kv_device import DEVICE

from kvctl.agent.model.paged_attention import BlockTable, PageTableAttention
from kvctl.agent.pool import Defragmenter, DefragTrigger, PagePool
from kvctl.agent.pool.storage import KVStorage

PAGE_SIZE = 4
SEGMENT_PAGES = 8
LAYERS = 2
KV_HEADS, HEAD_DIM = 2, 2


def layer_tags(tags: list[float], layer: int) -> torch.Tensor:
    """K of every token in `layer`: tag * 10 + layer (V is its negative)."""
    return torch.tensor(tags, dtype=torch.float64) * 10 + layer


def is_run_in_one_segment(pages: list[int]) -> bool:
    return bool(pages) and all(
        p == pages[0] + i and p // SEGMENT_PAGES == pages[0] // SEGMENT_PAGES
        for i, p in enumerate(pages)
    )


def lies_in(view: torch.Tensor, storage: KVStorage) -> bool:
    start = view.data_ptr()
    return any(
        s.data_ptr() <= start < s.data_ptr() + s.numel() * s.element_size()
        for s in storage._segments
    )


class ZeroCopyReadMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")

    @initialize(segments=st.integers(1, 3), batch=st.integers(1, 6))
    def start(self, segments: int, batch: int) -> None:
        self.pool = PagePool(segments * SEGMENT_PAGES, PAGE_SIZE, SEGMENT_PAGES)
        self.storage = KVStorage(
            segments,
            SEGMENT_PAGES,
            PAGE_SIZE,
            LAYERS,
            KV_HEADS,
            HEAD_DIM,
            torch.float64,
            device=DEVICE,
        )
        self.defrag = Defragmenter(self.pool, self.storage, batch_pages=batch)
        self.reader = PageTableAttention(self.storage, compiled=True)
        self.tags: dict[int, list[float]] = {}
        self.ids = itertools.count()
        self.next_tag = itertools.count(1)

    def _write(self, seq: int, first: int, count: int) -> None:
        """Write fresh tags into tokens [first, first + count) of `seq`, in every layer."""
        if not count:
            return
        pages = self.pool.table(seq).pages
        positions = range(first, first + count)
        tags = [float(next(self.next_tag)) for _ in positions]
        slot_pages = torch.tensor([pages[t // PAGE_SIZE] for t in positions])
        slot_offsets = torch.tensor([t % PAGE_SIZE for t in positions])
        for layer in range(LAYERS):
            k = layer_tags(tags, layer).view(-1, 1, 1).expand(-1, KV_HEADS, HEAD_DIM)
            self.storage.write(layer, slot_pages, slot_offsets, k.to(DEVICE), -k.to(DEVICE))
        self.tags[seq].extend(tags)

    @rule(target=sequences, tokens=st.integers(1, 20))
    def allocate(self, tokens: int):
        if not self.pool.can_allocate(tokens):
            return None
        seq = next(self.ids)
        self.pool.allocate(seq, tokens)
        self.tags[seq] = []
        self._write(seq, 0, tokens)
        return seq

    @rule(seq=sequences, tokens=st.integers(1, 7))
    def append(self, seq, tokens: int) -> None:
        if seq not in self.tags or not self.pool.can_append(seq, tokens):
            return
        first = self.pool.table(seq).num_tokens
        copies = self.pool.append(seq, tokens)
        if copies:
            self.storage.copy_pages([c.src for c in copies], [c.dst for c in copies])
        self._write(seq, first, tokens)

    @rule(target=sequences, seq=sequences)
    def fork(self, seq):
        if seq not in self.tags:
            return None
        child = next(self.ids)
        self.pool.fork(seq, child)
        self.tags[child] = list(self.tags[seq])
        return child

    @rule(seq=consumes(sequences))
    def free(self, seq) -> None:
        if seq not in self.tags:
            return
        self.pool.free(seq)
        del self.tags[seq]

    @rule(pages=st.integers(1, 6))
    def defrag_step(self, pages: int) -> None:
        self.defrag.step(pages)

    @rule()
    def full_defrag(self) -> None:
        assert self.defrag.run(DefragTrigger.MANUAL).complete

    # ---- reading back ---------------------------------------------------------------------

    @invariant()
    def every_sequence_reads_back_its_tags_through_views(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.invariants.check()
        for seq, tags in self.tags.items():
            pages = list(self.pool.table(seq).pages)
            run = is_run_in_one_segment(pages)
            assert (self.storage.run_of(pages) is not None) == run, pages
            for layer in range(LAYERS):
                k, v = self.storage.read_sequence(layer, pages)
                assert lies_in(k, self.storage) == lies_in(v, self.storage) == run, pages
                expected = layer_tags(tags, layer).to(DEVICE)
                got_k = k.reshape(-1, KV_HEADS, HEAD_DIM)[: len(tags)]
                got_v = v.reshape(-1, KV_HEADS, HEAD_DIM)[: len(tags)]
                assert torch.equal(got_k, expected[:, None, None].expand_as(got_k)), (seq, layer)
                assert torch.equal(got_v, -expected[:, None, None].expand_as(got_v)), (seq, layer)

    @invariant()
    def every_sequence_reads_back_its_tags_through_block_tables(self) -> None:
        if not hasattr(self, "pool"):
            return
        live = [s for s, tags in self.tags.items() if tags]
        if not live:
            return
        tables = [list(self.pool.table(s).pages) for s in live]
        lengths = [len(self.tags[s]) for s in live]
        plan = self.reader.plan(tables, lengths)
        spanning = [
            row for row, pages in enumerate(tables) if len({p // SEGMENT_PAGES for p in pages}) > 1
        ]
        assert list(plan.rest) == spanning
        read = set(plan.rest)
        for table in plan.tables:
            rows = list(range(len(live))) if table.rows is None else table.rows.tolist()
            for layer in range(LAYERS):
                for i, row in enumerate(rows):
                    got_k, got_v = self._read_blocks(table, i, layer)
                    expected = layer_tags(self.tags[live[row]], layer).to(DEVICE)
                    assert torch.equal(got_k, expected), (live[row], layer)
                    assert torch.equal(got_v, -expected), (live[row], layer)
            read.update(rows)
        assert read == set(range(len(live)))

    def _read_blocks(
        self, table: BlockTable, i: int, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `i`'s K and V tags as a page-table kernel reads them: the full blocks whole, then
        the partial block through the mask, from the segment's token rows."""
        mask = table.block_mask
        full = int(mask.full_kv_num_blocks[i, 0, 0])
        partial = int(mask.kv_num_blocks[i, 0, 0])
        rows = [
            r
            for block in mask.full_kv_indices[i, 0, 0, :full].tolist()
            for r in range(block * PAGE_SIZE, (block + 1) * PAGE_SIZE)
        ]
        for block in mask.kv_indices[i, 0, 0, :partial].tolist():
            for r in range(block * PAGE_SIZE, (block + 1) * PAGE_SIZE):
                b, zero, kv = (torch.tensor(x, device=DEVICE) for x in (i, 0, r))
                if mask.mask_mod(b, zero, zero, kv):
                    rows.append(r)
        keys, values = self.storage.token_rows(table.segment, layer)
        index = torch.tensor(rows, dtype=torch.long, device=DEVICE)
        return keys.index_select(0, index)[:, 0, 0], values.index_select(0, index)[:, 0, 0]


ZeroCopyReadMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestZeroCopyRead = ZeroCopyReadMachine.TestCase
