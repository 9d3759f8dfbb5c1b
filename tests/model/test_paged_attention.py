"""Attention read where the K/V lie: page views and page-table block masks against the gather.

The gather path (pages copied into a padded buffer, then SDPA) is the reference: every other way
of reading must give the same attention. Page views and the repeat straight from them are the
same values and the same operations, so they must be equal bit for bit; FlexAttention sums in
another order, so it must be close (1e-5 on attention, the model tests' 1e-4 on logits) and give
the same greedy tokens.
"""

from __future__ import annotations

import os

import pytest
import torch
from kv_device import DEVICE

from kvctl.agent.model import (
    BatchLayout,
    ContiguousKVCache,
    attend_decode,
    attend_one,
    attention,
    key_mask,
)
from kvctl.agent.model.attention import chunk_mask
from kvctl.agent.model.paged_attention import BlockTable, PageTableAttention, attend_pages
from kvctl.agent.pool import PagePool
from kvctl.agent.pool.storage import KVStorage
from kvctl.agent.runtime import paged_cache
from kvctl.agent.runtime.paged_cache import PagedKVCache

# On the CPU these tests run FlexAttention uncompiled on purpose (exact, slow): no warning.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

PAGE_SIZE = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def random_storage(segments: int = 3, segment_pages: int = 8, layers: int = 2) -> KVStorage:
    storage = KVStorage(
        segments, segment_pages, PAGE_SIZE, layers, KV_HEADS, HEAD_DIM, device=DEVICE
    )
    gen = torch.Generator().manual_seed(segments * 100 + segment_pages)
    pages = storage.num_pages
    contents = torch.randn(pages, layers, 2, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    storage.fill_pages(range(pages), contents.to(DEVICE))
    return storage


def gathered_decode(
    storage: KVStorage, layer: int, q: torch.Tensor, tables: list[list[int]], lengths: list[int]
) -> torch.Tensor:
    """The gather path: pages into a padded batch, then `attend_decode`."""
    width = max(len(t) for t in tables)
    padded = [t + [t[0]] * (width - len(t)) for t in tables]
    keys, values = storage.gather(layer, torch.tensor(padded))
    valid = key_mask(lengths, width * PAGE_SIZE, storage.device)
    return attend_decode(q, keys, values, valid)


# ---- attend_pages: the prefill reader -----------------------------------------------------


@pytest.mark.parametrize(("t", "cached"), [(1, 0), (1, 10), (5, 0), (6, 7), (16, 0)])
@pytest.mark.parametrize("pages", [[3, 4, 5, 6], [12, 2, 9, 7]], ids=["run", "scattered"])
def test_attend_pages_equals_attend_one_bit_for_bit(t: int, cached: int, pages: list[int]) -> None:
    storage = random_storage()
    gen = torch.Generator().manual_seed(t + cached)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    total = cached + t
    for layer in range(2):
        k_pages, v_pages = storage.read_sequence(layer, pages)
        k_flat, v_flat = storage.gather(layer, torch.tensor([pages]))
        expected = attend_one(q, k_flat[0, :total], v_flat[0, :total], cached)
        assert torch.equal(attend_pages(q, k_pages, v_pages, cached), expected)


def test_attend_pages_refuses_more_tokens_than_pages() -> None:
    storage = random_storage()
    k, v = storage.read_sequence(0, [1, 2])
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        attend_pages(torch.zeros(2, HEADS, HEAD_DIM, device=DEVICE), k, v, cached_len=7)


# ---- PageTableAttention: the decode reader ------------------------------------------------

# Segments of 8 pages: 0-7 | 8-15 | 16-23.
MIXED_TABLES = [
    [1, 2, 3],  # a run, last page partly filled
    [13, 9, 12],  # scattered in one segment, full pages
    [1, 2, 6],  # shares two pages with row 0 (a fork that has since diverged)
    [7, 8],  # two segments: gathered
    [15, 16, 17],  # consecutive ids across a segment boundary: gathered
    [20],  # one page, one token
    [4, 5, 6, 7],  # a run filling the end of a segment
]
MIXED_LENGTHS = [10, 12, 9, 5, 11, 1, 13]


def test_plan_groups_rows_by_segment_and_leaves_the_others_to_gather() -> None:
    storage = random_storage()
    plan = PageTableAttention(storage, compiled=False).plan(MIXED_TABLES, MIXED_LENGTHS)
    assert plan.rest == (3, 4)
    by_segment = {t.segment: t.rows.tolist() for t in plan.tables if t.rows is not None}
    assert by_segment == {0: [0, 2, 6], 1: [1], 2: [5]}
    whole = PageTableAttention(storage, compiled=False).plan([[1, 2], [5]], [8, 3])
    assert whole.rest == () and len(whole.tables) == 1 and whole.tables[0].rows is None


def test_plan_refuses_a_table_too_short_for_its_length() -> None:
    storage = random_storage()
    with pytest.raises(ValueError, match="cannot hold"):
        PageTableAttention(storage, compiled=False).plan([[1, 2]], [9])


@pytest.mark.parametrize("layer", [0, 1])
def test_flex_decode_equals_the_gather_on_a_mixed_batch(layer: int) -> None:
    storage = random_storage()
    gen = torch.Generator().manual_seed(layer)
    q = torch.randn(len(MIXED_TABLES), HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    expected = gathered_decode(storage, layer, q, MIXED_TABLES, MIXED_LENGTHS)
    reader = PageTableAttention(storage)
    plan = reader.plan(MIXED_TABLES, MIXED_LENGTHS)
    for table in plan.tables:
        assert table.rows is not None
        got = reader.attend(layer, q, table)
        torch.testing.assert_close(got, expected[table.rows], atol=1e-5, rtol=1e-5)


def read_block_table(
    storage: KVStorage, layer: int, q: torch.Tensor, table: BlockTable
) -> torch.Tensor:
    """What a compiled kernel computes from a block table: only the listed blocks are read, full
    blocks whole, the partial ones row by row through `mask_mod`."""
    mask = table.block_mask
    keys, values = storage.token_rows(table.segment, layer)
    queries = q if table.rows is None else q[table.rows]
    out = []
    for i in range(table.count):
        full = int(mask.full_kv_num_blocks[i, 0, 0])
        partial = int(mask.kv_num_blocks[i, 0, 0])
        rows = [
            r
            for block in mask.full_kv_indices[i, 0, 0, :full].tolist()
            for r in range(block * PAGE_SIZE, (block + 1) * PAGE_SIZE)
        ]
        for block in mask.kv_indices[i, 0, 0, :partial].tolist():
            for r in range(block * PAGE_SIZE, (block + 1) * PAGE_SIZE):
                b, zero, kv = (torch.tensor(x, device=storage.device) for x in (i, 0, r))
                if mask.mask_mod(b, zero, zero, kv):
                    rows.append(r)
        index = torch.tensor(rows, device=storage.device)
        k, v = keys.index_select(0, index), values.index_select(0, index)
        out.append(attend_one(queries[i : i + 1], k, v, cached_len=len(rows) - 1))
    return torch.cat(out)


@pytest.mark.parametrize("layer", [0, 1])
def test_compiled_block_tables_list_exactly_each_sequences_pages(layer: int) -> None:
    """The tables a compiled kernel reads (padded batch, fixed width, a mask only on each last
    page) hold the same keys as the gather, without compiling anything."""
    storage = random_storage()
    gen = torch.Generator().manual_seed(10 + layer)
    q = torch.randn(len(MIXED_TABLES), HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    expected = gathered_decode(storage, layer, q, MIXED_TABLES, MIXED_LENGTHS)
    reader = PageTableAttention(storage, compiled=True)
    plan = reader.plan(MIXED_TABLES, MIXED_LENGTHS)
    widths = set()
    for table in plan.tables:
        assert table.rows is not None
        padded = table.block_mask.kv_num_blocks.shape[0]
        assert padded == 1 << (table.count - 1).bit_length()
        assert not table.block_mask.full_kv_num_blocks[table.count :].any()
        assert not table.block_mask.kv_num_blocks[table.count :].any()
        widths.add(table.block_mask.full_kv_indices.shape[-1])
        got = read_block_table(storage, layer, q, table)
        torch.testing.assert_close(got, expected[table.rows], atol=1e-5, rtol=1e-5)
    assert len(widths) == 1  # one width whatever the lengths: no recompilation


@pytest.mark.skipif(
    DEVICE == "cpu" and not os.environ.get("KVCTL_COMPILE_TESTS"),
    reason="compiles FlexAttention on the CPU (tens of seconds); set KVCTL_COMPILE_TESTS=1",
)
def test_compiled_flex_decode_equals_the_gather() -> None:
    storage = random_storage()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(MIXED_TABLES), HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    expected = gathered_decode(storage, 1, q, MIXED_TABLES, MIXED_LENGTHS)
    reader = PageTableAttention(storage, compiled=True)
    for table in reader.plan(MIXED_TABLES, MIXED_LENGTHS).tables:
        assert table.rows is not None
        got = reader.attend(1, q, table)
        torch.testing.assert_close(got, expected[table.rows], atol=1e-5, rtol=1e-5)


# ---- PagedKVCache: the read paths through the whole model ---------------------------------

SEGMENT_PAGES = 8


def fragmented_pool(storage: KVStorage, holes: bool) -> PagePool:
    """A pool whose next allocations land in runs (no holes) or on scattered pages (holes)."""
    pool = PagePool(storage.num_pages, PAGE_SIZE, SEGMENT_PAGES, storage.bytes_per_page)
    if holes:
        for i in range(storage.num_pages):
            pool.allocate(("filler", i), PAGE_SIZE)
        for i in range(0, storage.num_pages, 3):
            pool.free(("filler", i))
    return pool


def model_storage(model, segments: int, segment_pages: int = SEGMENT_PAGES) -> KVStorage:
    config = model.config
    return KVStorage(
        segments,
        segment_pages,
        PAGE_SIZE,
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        device=DEVICE,
    )


def prefill_logits(model, prompts: list[list[int]], holes: bool) -> torch.Tensor:
    storage = model_storage(model, 6)
    pool = fragmented_pool(storage, holes)
    cache = PagedKVCache(pool, storage, "gather")
    for i, prompt in enumerate(prompts):
        pool.allocate(i, len(prompt))
    runs = [storage.run_of(pool.table(i).pages) is not None for i in range(len(prompts))]
    assert all(runs) if not holes else not any(runs[:2])
    layout = BatchLayout(tuple(range(len(prompts))), (0,) * len(prompts), tuple(map(len, prompts)))
    cache.begin_step(layout)
    tokens = torch.tensor([t for p in prompts for t in p], device=DEVICE)
    hidden = model(tokens, layout.positions(DEVICE), cache)
    return model.logits(hidden)


def test_prefill_through_page_views_equals_prefill_through_gathers(demo) -> None:
    _, model, _ = demo
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (13, 9, 1, 6)]
    assert torch.equal(prefill_logits(model, prompts, False), prefill_logits(model, prompts, True))


def test_a_mixed_step_builds_each_chunk_mask_once_and_equals_the_contiguous_cache(
    demo, monkeypatch
) -> None:
    """Two decode tokens, a chunk after cached tokens and a fresh prompt in one step: the same
    logits as the contiguous cache, with each chunk's mask built once for all layers (a mask
    per layer and chunk was part of what made a chunk cost more than its matmuls)."""
    _, model, _ = demo
    gen = torch.Generator().manual_seed(3)
    steps = [((0, 1, 2), (9, 5, 12)), ((0, 1, 2, 3), (1, 1, 7, 6))]
    storage = model_storage(model, 6)
    pool = fragmented_pool(storage, holes=True)
    paged = PagedKVCache(pool, storage, "gather")
    contiguous = ContiguousKVCache(model.config, max_seqs=4, max_len=32, device=DEVICE)
    built: list[tuple[int, int]] = []

    def counting(t: int, cached: int, *args):
        built.append((t, cached))
        return chunk_mask(t, cached, *args)

    monkeypatch.setattr(paged_cache, "chunk_mask", counting)
    monkeypatch.setattr(attention, "chunk_mask", counting)
    for seqs, new in steps:
        tokens = torch.randint(0, 256, (sum(new),), generator=gen).to(DEVICE)
        layout = contiguous.begin_step(seqs, new)
        for seq, n in zip(seqs, new, strict=True):
            if seq in pool:
                pool.append(seq, n)
            else:
                pool.allocate(seq, n)
        built.clear()
        paged.begin_step(layout)
        got = model.logits(model(tokens, layout.positions(DEVICE), paged))
        chunks = [(n, c) for c, n in zip(layout.cached_lens, new, strict=True) if n > 1]
        assert sorted(built) == sorted(chunks)
        expected = model.logits(model(tokens, layout.positions(DEVICE), contiguous))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


DECODE_SEGMENT_PAGES = 16


def decode_run(
    model, read_path: str, steps: int = 10
) -> tuple[torch.Tensor, list[tuple[list[int], list[int]]]]:
    """A mixed decode batch: runs, scattered pages, a fork sharing pages, sequences across
    segments; every length off the page size somewhere along the way. Returns every step's
    logits and, per step, the rows whose pages span segments and the rows the cache gathered."""
    storage = model_storage(model, 4, DECODE_SEGMENT_PAGES)
    pool = PagePool(storage.num_pages, PAGE_SIZE, DECODE_SEGMENT_PAGES, storage.bytes_per_page)
    cache = PagedKVCache(pool, storage, read_path)  # type: ignore[arg-type]
    pool.allocate("a", 4 * 5)
    pool.allocate("b", 4 * 3)
    pool.allocate("c", 4 * 2)
    pool.free("b")  # a hole of 3 pages
    prompts = {0: 13, 1: 7, 2: 30, 3: 9}
    for seq, n in prompts.items():
        pool.allocate(seq, n)
    layout = BatchLayout(tuple(prompts), (0,) * 4, tuple(prompts.values()))
    cache.begin_step(layout)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (sum(prompts.values()),), generator=gen).to(DEVICE)
    hidden = model(tokens, layout.positions(DEVICE), cache)
    last = model.logits(hidden[layout.last_token_indices(DEVICE)]).argmax(-1)
    pool.fork(0, 4)  # shares every page of 0, its last one partly filled
    lengths = {**prompts, 4: prompts[0]}
    seqs = (0, 1, 2, 3, 4)
    last = torch.cat([last, last[:1]])
    logits, paths = [], []
    for _ in range(steps):
        for seq in seqs:
            copies = pool.append(seq, 1)
            if copies:
                storage.copy_pages([c.src for c in copies], [c.dst for c in copies])
        layout = BatchLayout(seqs, tuple(lengths[s] for s in seqs), (1,) * len(seqs))
        cache.begin_step(layout)
        step_logits = model.logits(model(last, layout.positions(DEVICE), cache))
        logits.append(step_logits)
        last = step_logits.argmax(-1)
        spanning = [
            row
            for row, seq in enumerate(seqs)
            if len({p // DECODE_SEGMENT_PAGES for p in pool.table(seq).pages}) > 1
        ]
        step = cache._step
        assert step is not None
        gathered = list(range(len(seqs))) if step.blocks is None else list(step.blocks.rest)
        paths.append((spanning, gathered))
        for seq in seqs:
            lengths[seq] += 1
    pool.invariants.check()
    return torch.stack(logits), paths


@pytest.mark.slow
def test_flex_decode_matches_the_gather_through_the_model(demo) -> None:
    _, model, _ = demo
    expected, _ = decode_run(model, "gather")
    got, paths = decode_run(model, "flex")
    for spanning, gathered in paths:  # only sequences across segments are gathered
        assert gathered == spanning
    assert any(0 < len(spanning) < 5 for spanning, _ in paths)  # both paths in one step
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_auto_reads_in_place_only_on_cuda() -> None:
    storage = random_storage()
    pool = PagePool(storage.num_pages, PAGE_SIZE, SEGMENT_PAGES, storage.bytes_per_page)
    assert PagedKVCache(pool, storage).decode_reads_in_place == (storage.device.type == "cuda")
    assert not PagedKVCache(pool, storage, "gather").decode_reads_in_place
    assert PagedKVCache(pool, storage, "flex").decode_reads_in_place
    with pytest.raises(ValueError, match="read_path"):
        PagedKVCache(pool, storage, "views")  # type: ignore[arg-type]


def test_auto_falls_back_to_gathering_when_flex_fails(demo, monkeypatch, caplog) -> None:
    _, model, _ = demo
    expected, _ = decode_run(model, "gather", steps=3)

    def broken(self, layer, q, table):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(PageTableAttention, "attend", broken)
    monkeypatch.setattr(
        PagedKVCache,
        "__init__",
        _with_reader(PagedKVCache.__init__),
    )
    got, _ = decode_run(model, "auto", steps=3)
    assert torch.equal(got, expected)
    assert "FlexAttention failed" in caplog.text


def _with_reader(init):
    """`PagedKVCache.__init__` that reads in place under "auto" whatever the device."""

    def wrapped(self, pool, storage, read_path="auto"):
        init(self, pool, storage, read_path)
        if read_path == "auto":
            self._in_place = PageTableAttention(storage, compiled=False)

    return wrapped
