"""KVStorage: page copies, the model's writes and gathers, segments, and the whole pool stack.

Contents are built so that every element of every page is distinct, and every check compares
exact values, so a copy to the wrong page, segment, layer, K/V half, head or offset fails.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from kv_device import DEVICE

from kvctl.agent.pool.defrag import Defragmenter, DefragTrigger
from kvctl.agent.pool.page_pool import PagePool, PageTable
from kvctl.agent.pool.resize import PoolResizer
from kvctl.agent.pool.storage import KVStorage, _plan_copy

# A small page: 2 layers, K and V, 2 tokens, 2 kv heads, head_dim 3 -> 48 elements.
SHAPE = {"page_size": 2, "num_layers": 2, "num_kv_heads": 2, "head_dim": 3}
PAGE_ELEMENTS = 2 * 2 * 2 * 2 * 3


def make_storage(num_segments: int, segment_pages: int, **kwargs: object) -> KVStorage:
    kwargs.setdefault("device", DEVICE)
    return KVStorage(num_segments, segment_pages, **SHAPE, **kwargs)  # type: ignore[arg-type]


def page_contents(page: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct values for every element of page `page`: `[layers, 2, ps, kvh, hd]`."""
    values = torch.arange(PAGE_ELEMENTS, dtype=torch.float32) + 100 * page
    return values.reshape(2, 2, 2, 2, 3).to(dtype)


def fill_distinct(storage: KVStorage) -> None:
    pages = list(range(storage.num_pages))
    storage.fill_pages(pages, torch.stack([page_contents(p, storage.dtype) for p in pages]))


def expected_after(num_pages: int, src: list[int], dst: list[int]) -> torch.Tensor:
    contents = {p: page_contents(p) for p in range(num_pages)}
    for s, d in zip(src, dst, strict=True):
        contents[d] = page_contents(s)
    return torch.stack([contents[p] for p in range(num_pages)])


# ---- size ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "expected"), [(torch.float32, 65536), (torch.float16, 32768), (torch.bfloat16, 32768)]
)
def test_bytes_per_page_of_the_demo_shape(dtype: torch.dtype, expected: int) -> None:
    storage = KVStorage(3, 8, 16, 4, 4, 32, dtype=dtype, device="cpu")
    # layers 4 * (K, V) 2 * page_size 16 * kv_heads 4 * head_dim 32 * element size
    assert storage.bytes_per_page == expected
    assert storage.num_pages == 24
    assert storage.nbytes == 24 * expected
    assert storage.dtype == dtype
    assert storage.device == torch.device("cpu")


def test_new_pages_are_zero() -> None:
    storage = make_storage(2, 3)
    assert torch.equal(storage.read_pages(range(6)), torch.zeros(6, 2, 2, 2, 2, 3))


# ---- copy_pages ---------------------------------------------------------------------------

# Every run of destinations copied straight from its sources, or everything through staging.
PATHS = pytest.mark.parametrize("direct_run_bytes", [1, 1 << 30], ids=["direct", "staged"])


@PATHS
def test_copy_within_one_segment_with_interleaved_sources_and_destinations(
    direct_run_bytes: int,
) -> None:
    storage = make_storage(1, 8, direct_run_bytes=direct_run_bytes)
    fill_distinct(storage)
    src, dst = [7, 3, 5, 1], [0, 2, 4, 6]  # 0 1 2 3 4 5 6 7: dst, src alternate
    storage.copy_pages(src, dst)
    # page 0 <- 7, 2 <- 3, 4 <- 5, 6 <- 1; sources keep their contents
    assert torch.equal(storage.read_pages(range(8)), expected_after(8, src, dst))


@PATHS
def test_copy_across_segments_in_every_direction(direct_run_bytes: int) -> None:
    storage = make_storage(3, 4, direct_run_bytes=direct_run_bytes)  # pages 0-3 | 4-7 | 8-11
    fill_distinct(storage)
    src = [11, 10, 6, 1, 2, 2, 11]
    dst = [0, 3, 5, 8, 9, 7, 4]  # by segment: 2->0 2->0 1->1 0->2 0->2 (8-9 a run) 0->1 2->1
    storage.copy_pages(src, dst)
    assert torch.equal(storage.read_pages(range(12)), expected_after(12, src, dst))


@PATHS
def test_copy_like_a_defragmentation_highest_sources_into_lowest_holes(
    direct_run_bytes: int,
) -> None:
    storage = make_storage(2, 8, direct_run_bytes=direct_run_bytes)
    fill_distinct(storage)
    src = [15, 14, 13, 9, 8, 7, 6]  # descending sources, one run across the segment boundary
    dst = [0, 1, 2, 3, 4, 10, 11]  # ascending holes: run 0-4 in segment 0, 10-11 in segment 1
    storage.copy_pages(src, dst)
    assert torch.equal(storage.read_pages(range(16)), expected_after(16, src, dst))


@PATHS
def test_copy_into_a_run_that_lies_between_its_own_sources(direct_run_bytes: int) -> None:
    storage = make_storage(1, 8, direct_run_bytes=direct_run_bytes)
    fill_distinct(storage)
    src, dst = [1, 6, 4], [2, 3, 5]  # destinations 2-3 sit inside the source span 1-6
    storage.copy_pages(src, dst)
    assert torch.equal(storage.read_pages(range(8)), expected_after(8, src, dst))


@pytest.mark.parametrize("num_segments", [1, 3])
def test_copy_through_a_staging_buffer_smaller_than_the_batch(num_segments: int) -> None:
    storage = make_storage(num_segments, 12 // num_segments, staging_bytes=1)  # one page at a time
    fill_distinct(storage)
    src, dst = [11, 10, 9, 8, 7, 1], [0, 2, 3, 4, 5, 6]
    storage.copy_pages(src, dst)
    assert torch.equal(storage.read_pages(range(12)), expected_after(12, src, dst))


@PATHS
def test_one_source_can_be_copied_to_several_destinations(direct_run_bytes: int) -> None:
    storage = make_storage(2, 4, direct_run_bytes=direct_run_bytes)
    fill_distinct(storage)
    storage.copy_pages([5, 5, 6], [0, 1, 7])
    assert torch.equal(storage.read_pages(range(8)), expected_after(8, [5, 5, 6], [0, 1, 7]))


def test_empty_copy_changes_nothing() -> None:
    storage = make_storage(2, 4)
    fill_distinct(storage)
    storage.copy_pages([], [])
    assert torch.equal(storage.read_pages(range(8)), expected_after(8, [], []))


@pytest.mark.parametrize(
    ("src", "dst", "error"),
    [
        ([1, 2], [3], ValueError),  # lengths differ
        ([1, 2], [3, 3], ValueError),  # one destination twice
        ([1, 2], [2, 3], ValueError),  # a destination is a source
        ([1], [8], IndexError),  # beyond the pool
        ([-1], [0], IndexError),
    ],
)
def test_bad_copies_are_refused_and_change_nothing(
    src: list[int], dst: list[int], error: type[Exception]
) -> None:
    storage = make_storage(2, 4)
    fill_distinct(storage)
    with pytest.raises(error):
        storage.copy_pages(src, dst)
    assert torch.equal(storage.read_pages(range(8)), expected_after(8, [], []))


# ---- write and gather ---------------------------------------------------------------------


def token_kv(count: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct K and V for `count` tokens: `[count, kvh 2, hd 3]` each."""
    k = torch.arange(count * 6, dtype=torch.float32).reshape(count, 2, 3) + start
    return k, -k - 1


@pytest.mark.parametrize("num_segments", [1, 4])
@pytest.mark.parametrize("prepared", [False, True])
def test_write_then_gather_scattered_pages(num_segments: int, prepared: bool) -> None:
    storage = make_storage(num_segments, 16 // num_segments)
    # Two sequences on scattered pages (segments 3, 0, 2 and 1, 3 when there are 4 of 4 pages).
    tables = [[13, 2, 9], [5, 14]]
    lengths = [6, 3]  # page_size 2: 3 full pages; one full page and one token
    slots = [
        (t, seq, pages[t // 2], t % 2)
        for seq, (pages, n) in enumerate(zip(tables, lengths, strict=True))
        for t in range(n)
    ]
    page = torch.tensor([s[2] for s in slots])
    offset = torch.tensor([s[3] for s in slots])
    k, v = token_kv(len(slots), start=1000)
    if prepared:
        storage.write(1, storage.index_slots(page, offset), None, k, v)
    else:
        storage.write(1, page, offset, k, v)

    page_ids = torch.tensor([[13, 2, 9], [5, 14, 0]])  # the second row padded with page 0
    index = storage.index_pages(page_ids) if prepared else page_ids
    got_k, got_v = storage.gather(1, index)
    assert got_k.shape == got_v.shape == (2, 6, 2, 3)
    for i, (t, seq, _, _) in enumerate(slots):
        assert torch.equal(got_k[seq, t], k[i]), (seq, t)
        assert torch.equal(got_v[seq, t], v[i]), (seq, t)
    # the unwritten slots read as zeros: sequence 1's second page past its token, and padding
    assert torch.equal(got_k[1, 3:], torch.zeros(3, 2, 3))
    # the other layer is untouched
    other_k, other_v = storage.gather(0, page_ids)
    assert not other_k.any() and not other_v.any()


def test_gather_reads_whole_pages_in_table_order() -> None:
    storage = make_storage(3, 4)
    fill_distinct(storage)
    page_ids = torch.tensor([[10, 1, 5], [0, 0, 7]])
    k, v = storage.gather(1, page_ids)
    for b in range(2):
        for j in range(3):
            page = int(page_ids[b, j])
            tokens = slice(2 * j, 2 * j + 2)
            assert torch.equal(k[b, tokens], page_contents(page)[1, 0]), (b, j)
            assert torch.equal(v[b, tokens], page_contents(page)[1, 1]), (b, j)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_copy_write_and_gather(dtype: torch.dtype) -> None:
    storage = make_storage(2, 4, dtype=dtype)
    tags = torch.arange(1, 9, dtype=dtype)  # page p holds p + 1 everywhere: exact in both dtypes
    storage.fill_pages(range(8), tags[:, None, None, None, None, None])
    storage.copy_pages([6, 1], [0, 5])
    got = storage.read_pages(range(8))
    assert got.dtype == dtype
    assert torch.equal(got[:, 0, 0, 0, 0, 0], torch.tensor([7, 2, 3, 4, 5, 2, 7, 8], dtype=dtype))
    assert torch.equal(got, got[:, :1, :1, :1, :1, :1].expand_as(got))
    k, v = token_kv(2, start=0)  # integers below 12: exact in both dtypes
    storage.write(0, torch.tensor([3, 4]), torch.tensor([1, 0]), k, v)  # cast from float32
    got_k, got_v = storage.gather(0, torch.tensor([[3, 4]]))
    assert got_k.dtype == got_v.dtype == dtype
    assert torch.equal(got_k[0, 1], k[0].to(dtype))
    assert torch.equal(got_k[0, 2], k[1].to(dtype))
    assert torch.equal(got_v[0, 2], v[1].to(dtype))
    assert torch.equal(got_k[0, 0], torch.full((2, 3), 4, dtype=dtype))  # page 3 offset 0: tag


# ---- reading in place ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pages", "expected"),
    [
        ([5], (1, 1)),
        ([4, 5, 6, 7], (1, 0)),  # a whole segment
        ([9, 10], (2, 1)),
        ([2, 3, 4], None),  # consecutive ids, but across the boundary of segments 0 and 1
        ([3, 4], None),
        ([1, 2, 4], None),  # a gap
        ([2, 1, 0], None),  # descending
        ([6, 7, 6], None),
        ([1, 1], None),
        ([], None),
    ],
)
def test_run_of_is_decided_from_the_ids(pages: list[int], expected: tuple | None) -> None:
    storage = make_storage(3, 4)  # pages 0-3 | 4-7 | 8-11
    assert storage.run_of(pages) == expected


def test_run_of_refuses_a_first_page_beyond_the_pool() -> None:
    storage = make_storage(2, 4)
    with pytest.raises(IndexError):
        storage.run_of([8])
    with pytest.raises(IndexError):
        storage.run_of([-1, 0])
    assert storage.run_of([7, 8]) is None  # runs off the top: not a run of this pool


def shares_memory(view: torch.Tensor, storage: KVStorage) -> bool:
    """Whether `view` lies inside one of the storage's segments (a view, not a copy)."""
    start = view.data_ptr()
    for segment in storage._segments:
        low = segment.data_ptr()
        if low <= start < low + segment.numel() * segment.element_size():
            return True
    return False


@pytest.mark.parametrize(
    "pages",
    [[5, 6, 7], [4], [0, 1, 2, 3], [6, 7, 8, 9], [11, 2, 7], [3, 3], [9, 8]],
    ids=["run", "one", "segment", "across", "scattered", "repeated", "descending"],
)
def test_read_sequence_is_a_view_for_runs_and_equals_the_gather(pages: list[int]) -> None:
    storage = make_storage(3, 4)
    fill_distinct(storage)
    for layer in range(2):
        k, v = storage.read_sequence(layer, pages)
        assert k.shape == v.shape == (len(pages), 2, 2, 3)
        is_run = storage.run_of(pages) is not None
        assert shares_memory(k, storage) == shares_memory(v, storage) == is_run
        for i, page in enumerate(pages):
            assert torch.equal(k[i], page_contents(page)[layer, 0]), (layer, i)
            assert torch.equal(v[i], page_contents(page)[layer, 1]), (layer, i)
        gathered_k, gathered_v = storage.gather(layer, torch.tensor([pages]))
        assert torch.equal(k.reshape(1, -1, 2, 3), gathered_k)
        assert torch.equal(v.reshape(1, -1, 2, 3), gathered_v)


def test_a_run_view_sees_later_writes_and_copies() -> None:
    """Zero-copy: a view taken before a write or a copy reads what they stored."""
    storage = make_storage(2, 4)
    fill_distinct(storage)
    k, v = storage.read_sequence(1, [1, 2, 3])
    new_k, new_v = token_kv(1, start=5000)
    storage.write(1, torch.tensor([2]), torch.tensor([1]), new_k, new_v)
    storage.copy_pages([6], [3])
    assert torch.equal(k[1, 1], new_k[0]) and torch.equal(v[1, 1], new_v[0])
    assert torch.equal(k[2], page_contents(6)[1, 0]) and torch.equal(v[2], page_contents(6)[1, 1])


def test_pages_view_bounds() -> None:
    storage = make_storage(2, 4)
    k, v = storage.pages_view(0, 1, 1, 3)
    assert k.shape == v.shape == (3, 2, 2, 3)
    for row, count in ((3, 2), (-1, 1), (0, 0), (0, 5)):
        with pytest.raises(IndexError):
            storage.pages_view(0, 0, row, count)


@pytest.mark.parametrize("layer", [0, 1])
def test_token_rows_hold_every_token_of_every_page_of_a_segment(layer: int) -> None:
    storage = make_storage(3, 4)
    fill_distinct(storage)
    per_page = storage.rows_per_page
    assert per_page == 2 * 2 * 2  # layers * (K, V) * page_size
    for segment in range(3):
        k_rows, v_rows = storage.token_rows(segment, layer)
        assert shares_memory(k_rows, storage) and shares_memory(v_rows, storage)
        assert k_rows.shape == v_rows.shape == (3 * per_page + 2, 2, 3)
        for row in range(4):
            page = page_contents(segment * 4 + row)
            tokens = slice(row * per_page, row * per_page + 2)
            assert torch.equal(k_rows[tokens], page[layer, 0]), (segment, row)
            assert torch.equal(v_rows[tokens], page[layer, 1]), (segment, row)


# ---- segments -----------------------------------------------------------------------------


def test_add_and_release_segments_keep_the_remaining_pages() -> None:
    storage = make_storage(2, 4)
    fill_distinct(storage)
    storage.add_segments(2)
    assert (storage.num_segments, storage.num_pages) == (4, 16)
    pages = storage.read_pages(range(16))
    assert torch.equal(pages[:8], expected_after(8, [], []))
    assert not pages[8:].any()  # new segments start zeroed
    storage.fill_pages([12], 7.0)
    storage.release_segments(1)
    assert (storage.num_segments, storage.num_pages) == (3, 12)
    assert torch.equal(storage.read_pages(range(8)), expected_after(8, [], []))
    storage.release_segments(2)
    assert torch.equal(storage.read_pages(range(4)), expected_after(4, [], []))


@pytest.mark.parametrize("count", [2, 3, -1])
def test_release_refuses_to_leave_no_segment(count: int) -> None:
    storage = make_storage(2, 4)
    with pytest.raises(ValueError, match="at most all but one"):
        storage.release_segments(count)
    assert storage.num_segments == 2


@pytest.mark.parametrize("num_segments", [2, 3])
def test_pages_beyond_a_released_segment_are_out_of_range(num_segments: int) -> None:
    storage = make_storage(num_segments, 4)
    storage.release_segments(1)
    with pytest.raises(IndexError):
        storage.copy_pages([4 * num_segments - 3], [0])
    beyond = 4 * num_segments - 3
    with pytest.raises(IndexError, match=rf"must be in \[0, {4 * (num_segments - 1)}\)"):
        storage.gather(0, torch.tensor([[0, beyond]], device="cpu"))  # host ids are checked
    with pytest.raises(IndexError):
        storage.write(
            0,
            torch.tensor([beyond], device="cpu"),
            torch.tensor([0], device="cpu"),
            torch.zeros(1, 2, 3),
            torch.zeros(1, 2, 3),
        )
    with pytest.raises(IndexError):
        storage.write(
            0,
            torch.tensor([-1], device="cpu"),
            torch.tensor([0], device="cpu"),
            torch.zeros(1, 2, 3),
            torch.zeros(1, 2, 3),
        )


# ---- the whole stack: pool + defragmenter + resizer over real storage ---------------------

PAGE_SIZE = 4
LAYERS = 2


def make_storage_of(segments: int, segment_pages: int, direct_run_bytes: int) -> KVStorage:
    """Storage for the whole-stack tests: 2 layers, 2 KV heads of 3, on the test device."""
    return KVStorage(
        segments,
        segment_pages,
        PAGE_SIZE,
        LAYERS,
        2,
        3,
        device=DEVICE,
        direct_run_bytes=direct_run_bytes,
    )


def write_tags(storage: KVStorage, table: PageTable, tag: int) -> None:
    """Token t of the sequence tagged `tag` holds K = tag*1000 + t + layer*100000, V = -K."""
    t = torch.arange(table.num_tokens)
    pages = torch.tensor(table.pages)[t // PAGE_SIZE]
    for layer in range(LAYERS):
        values = (tag * 1000 + t + layer * 100_000).float()
        k = values[:, None, None].expand(-1, 2, 3)
        storage.write(layer, pages, t % PAGE_SIZE, k, -k)


def check_tags(storage: KVStorage, table: PageTable, tag: int) -> None:
    t = torch.arange(table.num_tokens)
    for layer in range(LAYERS):
        k, v = storage.gather(layer, torch.tensor([table.pages]))
        expected = (tag * 1000 + t + layer * 100_000).float()[:, None, None].expand(-1, 2, 3)
        assert torch.equal(k[0, : table.num_tokens], expected), (table.seq_id, layer)
        assert torch.equal(v[0, : table.num_tokens], -expected), (table.seq_id, layer)


@PATHS
def test_defrag_grow_and_shrink_keep_every_sequence_readable(direct_run_bytes: int) -> None:
    rng = random.Random(7)
    storage = make_storage_of(4, 16, direct_run_bytes)
    pool = PagePool(64, PAGE_SIZE, segment_pages=16, bytes_per_page=storage.bytes_per_page)
    defrag = Defragmenter(pool, storage, batch_pages=5)
    resizer = PoolResizer(pool, defrag, storage)
    tags: dict[int, int] = {}

    def start(seq: int, tokens: int) -> None:
        write_tags(storage, pool.allocate(seq, tokens), seq)
        tags[seq] = seq

    for seq in range(16):  # 44 of 64 pages
        start(seq, rng.randint(5, 16))
    for seq in range(0, 16, 2):
        pool.free(seq)
        del tags[seq]
    for seq in range(16, 22):  # these land in the holes, some scattered
        start(seq, rng.randint(1, 10))
    for seq in (1, 5, 9, 17):  # grow in place: appended tokens get new tags too
        pool.append(seq, 5)
        write_tags(storage, pool.table(seq), seq)
    for seq in (3, 11, 19):
        pool.free(seq)
        del tags[seq]
    before = {seq: list(pool.table(seq).pages) for seq in tags}
    assert pool.stats().fragmentation_ratio > 0.3

    report = defrag.run(DefragTrigger.MANUAL)

    assert report.complete and report.pages_moved > 0
    assert report.bytes_moved == report.pages_moved * storage.bytes_per_page
    assert pool.stats().fragmentation_ratio == 0.0
    assert pool.stats().free_extents == 1
    assert any(pool.table(seq).pages != pages for seq, pages in before.items())
    for seq, tag in tags.items():
        check_tags(storage, pool.table(seq), tag)

    resizer.resize(96)
    assert (pool.capacity, storage.num_pages) == (96, 96)
    used = pool.used_pages
    start(30, 4 * (96 - used - 8))  # fills the pool up to the top, leaving 8 pages free
    for seq in (1, 5, 7):  # holes low in the pool, occupied pages high
        pool.free(seq)
        del tags[seq]
    for seq, tag in tags.items():
        check_tags(storage, pool.table(seq), tag)

    result = resizer.resize(pool.used_pages)

    assert result.pages_moved > 0
    assert pool.capacity == storage.num_pages == result.new_pages < 96
    assert max(max(pool.table(seq).pages) for seq in tags) < pool.capacity
    pool.invariants.check()
    for seq, tag in tags.items():
        check_tags(storage, pool.table(seq), tag)


# ---- copy_pages: every copy path against a page-by-page reference -------------------------
#
# Random batches, each checked against copying one page at a time: scattered and defrag-like
# (ascending runs) destinations, runs that cross segment boundaries on either side, runs whose
# destinations lie inside their own sources' span, one source copied many times.

COPY_PATHS = {
    # name: (direct_run_bytes, parallel_run_bytes, staging_bytes, numpy on CPU)
    "numpy-runs": (1, 1 << 30, None, True),
    "torch-runs": (1, 1, None, True),
    "mixed-runs": (3 * PAGE_ELEMENTS * 4, 6 * PAGE_ELEMENTS * 4, None, True),
    "staged": (1 << 30, 1, None, True),
    "staged-page-at-a-time": (1 << 30, 1, 1, True),
    "device-runs": (1, 1, None, False),  # what every device but the CPU runs: torch only
    "device-staged": (1 << 30, 1, 1, False),
}


def random_batch(
    rng: random.Random, num_pages: int, segment_pages: int
) -> tuple[list[int], list[int]]:
    """A batch `copy_pages` accepts: distinct destinations, none of them a source."""
    kind = rng.choice(["scattered", "runs", "boundary", "inside"])
    pages = list(range(num_pages))
    if kind == "boundary" and num_pages > segment_pages:  # both runs cross a segment boundary
        edge = segment_pages * rng.randint(1, num_pages // segment_pages - 1)
        half = max(1, min(segment_pages, num_pages // 4))
        dst = list(range(edge - rng.randint(1, half), edge + rng.randint(1, half)))
        rest = [p for p in pages if p not in dst]
        first = rng.randint(0, len(rest) - len(dst))
        return rest[first : first + len(dst)], dst
    if kind == "inside":  # destinations in the middle of their sources' span, one segment
        base = segment_pages * rng.randrange(num_pages // segment_pages)
        if segment_pages >= 4:
            dst = list(range(base + 1, base + segment_pages - 1, 2))
            src = [base, base + segment_pages - 1] * len(dst)
            return src[: len(dst)], dst
    count = rng.randint(1, num_pages // 2)
    if kind == "runs":  # highest pages into the lowest holes, like a defragmentation
        holes = sorted(rng.sample(pages, count))
        rest = [p for p in pages if p not in holes]
        return rest[-count:], holes
    rng.shuffle(pages)
    dst, rest = pages[:count], pages[count:]
    return [rng.choice(rest) for _ in range(count)], dst


@pytest.mark.parametrize("path", list(COPY_PATHS))
def test_copy_pages_matches_a_page_by_page_copy(path: str) -> None:
    direct_run_bytes, parallel_run_bytes, staging_bytes, numpy_copies = COPY_PATHS[path]
    rng = random.Random(path)
    for _ in range(60):
        segments, segment_pages = rng.randint(1, 4), rng.randint(2, 9)
        storage = make_storage(
            segments,
            segment_pages,
            direct_run_bytes=direct_run_bytes,
            parallel_run_bytes=parallel_run_bytes,
            staging_bytes=staging_bytes,
        )
        if not numpy_copies:
            storage._numpy_copies = False
        fill_distinct(storage)
        num_pages = storage.num_pages
        src, dst = random_batch(rng, num_pages, segment_pages)
        storage.copy_pages(src, dst)
        assert torch.equal(
            storage.read_pages(range(num_pages)), expected_after(num_pages, src, dst)
        ), (path, segments, segment_pages, src, dst)


@pytest.mark.parametrize("path", list(COPY_PATHS))
def test_copy_runs_that_cross_segment_boundaries_or_lie_inside_their_sources(path: str) -> None:
    direct_run_bytes, parallel_run_bytes, staging_bytes, numpy_copies = COPY_PATHS[path]
    storage = make_storage(
        3,
        4,  # pages 0-3 | 4-7 | 8-11
        direct_run_bytes=direct_run_bytes,
        parallel_run_bytes=parallel_run_bytes,
        staging_bytes=staging_bytes,
    )
    if not numpy_copies:
        storage._numpy_copies = False
    fill_distinct(storage)
    src = [2, 3, 4, 5, 11]  # 2-5 crosses the boundary 3|4 ...
    dst = [6, 7, 8, 9, 0]  # ... into 6-9, across the boundary 7|8
    storage.copy_pages(src, dst)
    assert torch.equal(storage.read_pages(range(12)), expected_after(12, src, dst))
    inside = make_storage(1, 8, direct_run_bytes=direct_run_bytes, staging_bytes=staging_bytes)
    if not numpy_copies:
        inside._numpy_copies = False
    fill_distinct(inside)
    inside.copy_pages([0, 7, 1], [3, 4, 5])  # the run 3-5 lies inside its sources' span 0-7
    assert torch.equal(inside.read_pages(range(8)), expected_after(8, [0, 7, 1], [3, 4, 5]))


def test_copy_takes_arrays_in_any_order_and_refuses_a_repeat_anywhere() -> None:
    storage = make_storage(2, 4)
    fill_distinct(storage)
    src, dst = np.array([7, 6, 0]), np.array([5, 1, 3])  # destinations not in order
    storage.copy_pages(src, dst)
    assert torch.equal(storage.read_pages(range(8)), expected_after(8, [7, 6, 0], [5, 1, 3]))
    with pytest.raises(ValueError, match="distinct"):
        storage.copy_pages([7, 6, 0], [3, 1, 3])  # the repeat is not next to itself
    with pytest.raises(ValueError, match="among the sources"):
        storage.copy_pages([7, 6, 2], [5, 2, 3])
    assert torch.equal(storage.read_pages(range(8)), expected_after(8, [7, 6, 0], [5, 1, 3]))


def test_the_copy_plan_grows_with_runs_not_pages() -> None:
    # 1,000 pages from the top segment into two holes, one of which crosses a segment boundary
    dst = np.concatenate((np.arange(100, 700), np.arange(900, 1300)))
    src = np.arange(3072, 4072)
    plan = _plan_copy(src, dst, segment_pages=1024, num_segments=4, direct_pages=4)
    assert [(s, d, start, end) for s, d, *_, start, end in plan.direct] == [
        (3, 0, 0, 600),
        (3, 0, 600, 724),  # 900-1023
        (3, 1, 724, 1000),  # 1024-1299
    ]
    assert plan.staged == [] and plan.index.shape == (1000,)


# ---- a decode batch's gather: in place, no reorder ------------------------------------------


@pytest.mark.parametrize("direct_bytes", [1, 3 * 48, 1 << 20], ids=["direct", "mixed", "staged"])
@pytest.mark.parametrize("num_segments", [1, 4])
def test_gather_batch_equals_gather_for_random_tables(num_segments: int, direct_bytes: int) -> None:
    """Stretches gathered in place and pages staged then scattered must land where the plain
    gather (by segment, then reordered) puts them, whatever the mix."""
    storage = make_storage(num_segments, 16 // num_segments, direct_gather_bytes=direct_bytes)
    fill_distinct(storage)
    rng = random.Random(num_segments * 7 + direct_bytes)
    for _ in range(20):
        rows = []
        for _ in range(rng.randint(1, 6)):
            start = rng.randrange(16)
            run = [(start + i) % 16 for i in range(rng.randint(1, 6))]  # wraps across segments
            rows.append(run + rng.choices(range(16), k=rng.randint(0, 3)))
        width = max(map(len, rows))
        padded = np.array([r + r[-1:] * (width - len(r)) for r in rows], dtype=np.int64)
        index = storage.index_batch(padded)
        buffers = storage.gather_buffers(index.buffer_pages)
        for layer in range(2):
            want_k, want_v = storage.gather(layer, torch.from_numpy(padded))
            got_k, got_v = storage.gather_batch(layer, index, buffers)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), padded
    if num_segments == 4 and direct_bytes == 1 << 20:
        assert index.scatter is not None  # the staged path ran


def test_index_batch_checks_host_ids() -> None:
    storage = make_storage(2, 4)
    for bad in (8, -1):
        with pytest.raises(IndexError):
            storage.index_batch(np.array([[0, bad]], dtype=np.int64))


def test_write_refuses_an_offset_beyond_the_page() -> None:
    """Slots are rows of a flat view: an offset past the page would land in another layer."""
    storage = make_storage(2, 4)
    k, v = token_kv(1, start=0)
    with pytest.raises(IndexError):
        storage.write(0, torch.tensor([1]), torch.tensor([2]), k, v)  # page_size is 2
    assert not storage.read_pages(range(8)).any()
