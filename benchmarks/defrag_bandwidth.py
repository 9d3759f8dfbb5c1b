"""Defragmentation throughput against a plain copy of the same bytes on the same device.

A defragmentation moves pages: plan, copy contents (`KVStorage.copy_pages`), switch page tables.
Its cost floor is the copy, so the honest yardstick is the device's own copy bandwidth, measured
in the same run: a contiguous `dst.copy_(src)` of as many bytes as the defragmentation moved, and
an `index_select` gather of as many whole pages (what a scattered copy costs without any
bookkeeping). The ratio defrag / plain copy says how much of the device's bandwidth a
defragmentation gets; the split between time in `copy_pages` and the rest says whether the copy
or the pool's bookkeeping (planning, relocation) is the bottleneck.

The pool is fragmented by a seeded churn of allocations and frees of random lengths, rebuilt
identically before every defragmentation. Rounds are paired and interleaved (defragmentations,
then baselines, then baselines, then defragmentations, ...): every ratio is taken within a round,
so drift on a shared machine hits both sides of it alike, and is reported as the median of the
per-round ratios with their min and max. Torch's CPU thread count defaults to the agent's
(`default_torch_threads`), since it changes the figures more than most code changes do.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from paired import (
    MIN_ROUNDS,
    Paired,
    command_line,
    environment,
    load_average,
    paired_rounds,
    spread,
)

from kvctl.agent.pool.defrag import Defragmenter, DefragReport, DefragTrigger
from kvctl.agent.pool.page_pool import PagePool
from kvctl.agent.pool.storage import KVStorage
from kvctl.agent.startup.wiring import default_torch_threads

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--pages", type=int, default=4096, help="pool capacity in pages")
    p.add_argument("--segment-pages", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--max-seq-pages", type=int, default=32, help="longest sequence, in pages")
    p.add_argument("--fill", type=float, default=0.6, help="pool occupancy after the churn")
    p.add_argument(
        "--batch-pages",
        default="64,256,1024,4096",
        help="comma-separated Defragmenter batch sizes to compare",
    )
    p.add_argument(
        "--rounds", "--repeats", type=int, default=15, help=f"paired rounds (at least {MIN_ROUNDS})"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=default_torch_threads(),
        help="torch CPU threads (default: the agent's, cores - 1; 0: torch's own default)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        p.error(f"--rounds must be at least {MIN_ROUNDS}: fewer pairs say little")
    args.batch_sizes = [int(b) for b in args.batch_pages.split(",")]
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The full command line, every option spelled out, so changed defaults do not matter."""
    options = [
        "--device", args.device, "--pages", args.pages, "--segment-pages", args.segment_pages,
        "--page-size", args.page_size, "--layers", args.layers, "--kv-heads", args.kv_heads,
        "--head-dim", args.head_dim, "--dtype", args.dtype, "--max-seq-pages", args.max_seq_pages,
        "--fill", args.fill, "--batch-pages", args.batch_pages, "--rounds", args.rounds,
        "--seed", args.seed, "--threads", args.threads,
    ]  # fmt: skip
    return shlex.join(["python", "benchmarks/defrag_bandwidth.py", *map(str, options)])


def fragmented_pool(args: argparse.Namespace, bytes_per_page: int) -> PagePool:
    """A pool after a seeded churn: a few rounds of filling it to 90% with sequences of random
    length, then finishing random ones until `--fill` of it is in use. The same arguments always
    give the same pool, so every repetition moves the same pages."""
    rng = random.Random(args.seed)
    pool = PagePool(args.pages, args.page_size, args.segment_pages, bytes_per_page)
    next_id = 0
    for _ in range(4):
        while pool.used_pages < 0.9 * pool.capacity:
            tokens = rng.randint(1, args.max_seq_pages * args.page_size)
            if not pool.can_allocate(tokens):
                break
            pool.allocate(next_id, tokens)
            next_id += 1
        running = pool.sequences()
        rng.shuffle(running)
        while pool.used_pages > args.fill * pool.capacity:
            pool.free(running.pop())
    return pool


class TimedCopier:
    """Wraps storage to add up the seconds spent in `copy_pages` (device synchronised)."""

    def __init__(self, storage: KVStorage, sync: Callable[[], None]) -> None:
        self.storage = storage
        self.sync = sync
        self.seconds = 0.0

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.sync()
        started = time.perf_counter()
        self.storage.copy_pages(src, dst)
        self.sync()
        self.seconds += time.perf_counter() - started


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    """Seconds `fn` takes, with the device idle before and after."""
    sync()
    started = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - started


def defragment(
    args: argparse.Namespace, copier: KVStorage | TimedCopier, batch: int, sync: Callable[[], None]
) -> tuple[float, DefragReport]:
    """Rebuild the fragmented pool (untimed) and time one full defragmentation of it."""
    storage = copier if isinstance(copier, KVStorage) else copier.storage
    pool = fragmented_pool(args, storage.bytes_per_page)
    defrag = Defragmenter(pool, copier, batch_pages=batch)
    reports: list[DefragReport] = []
    seconds = timed(lambda: reports.append(defrag.run(DefragTrigger.MANUAL)), sync)
    report = reports[0]
    assert report.complete and report.fragmentation_after == 0.0, report
    return seconds, report


def check_contents(args: argparse.Namespace, storage: KVStorage, batch: int) -> None:
    """Tag every page with its id, defragment, and check each table still finds its tags."""
    pool = fragmented_pool(args, storage.bytes_per_page)
    ids = torch.arange(storage.num_pages, dtype=torch.float32)
    storage.fill_pages(range(storage.num_pages), ids[:, None, None, None, None, None])
    tags = {seq: list(pool.table(seq).pages) for seq in pool.sequences()}
    Defragmenter(pool, storage, batch_pages=batch).run(DefragTrigger.MANUAL)
    for seq, old_pages in tags.items():
        got = storage.read_pages(pool.table(seq).pages)[:, -1, -1, -1, -1, -1]
        expected = torch.tensor(old_pages, dtype=storage.dtype, device=storage.device)
        if not torch.equal(got, expected):
            raise SystemExit(f"defragmentation corrupted sequence {seq}")


class Baselines:
    """The same bytes moved without any pool: one contiguous copy, and a gather of whole pages
    chosen at random from a pool-sized tensor into a contiguous buffer."""

    def __init__(self, storage: KVStorage, pages: int, seed: int) -> None:
        like = {"dtype": storage.dtype, "device": storage.device}
        row = storage.bytes_per_page // storage.dtype.itemsize
        self.src = torch.ones(pages * row, **like)
        self.dst = torch.empty_like(self.src)
        self.rows = torch.ones(storage.num_pages, row, **like)
        self.out = torch.empty(pages, row, **like)
        order = torch.randperm(storage.num_pages, generator=torch.Generator().manual_seed(seed))
        self.idx = order[:pages].to(storage.device)

    def plain_copy(self) -> None:
        self.dst.copy_(self.src)

    def gather_copy(self) -> None:
        torch.index_select(self.rows, 0, self.idx, out=self.out)


@dataclass
class Row:
    """One batch size's paired rounds; rates in bytes/s, times in seconds, one entry per round."""

    batch: int
    moved: int  # bytes one full defragmentation moves
    vs_plain: Paired  # defrag rate / plain copy rate
    gather: list[float] = field(default_factory=list)
    copy_s: list[float] = field(default_factory=list)  # of a defragmentation, in copy_pages
    other_s: list[float] = field(default_factory=list)  # the rest: planning, page tables

    @property
    def vs_gather(self) -> Paired:
        return Paired(self.vs_plain.ours, self.gather)

    @property
    def copy_vs_plain(self) -> Paired:
        """copy_pages' own rate against the plain copy: the copy side judged apart from the pool."""
        return Paired([self.moved / s for s in self.copy_s], self.vs_plain.base)


def measure(
    args: argparse.Namespace,
    storage: KVStorage,
    base: Baselines,
    moved: int,
    batch: int,
    sync: Callable[[], None],
) -> Row:
    """Paired rounds for one batch size. Our side is a defragmentation (timed whole) and a second
    one with `copy_pages` timed apart; the baseline side is a plain copy and a page gather."""
    gather: list[float] = []
    copy_s: list[float] = []
    other_s: list[float] = []

    def ours() -> float:
        seconds = defragment(args, storage, batch, sync)[0]
        copier = TimedCopier(storage, sync)
        total = defragment(args, copier, batch, sync)[0]
        copy_s.append(copier.seconds)
        other_s.append(total - copier.seconds)
        return moved / seconds

    def baseline() -> float:
        gather.append(moved / timed(base.gather_copy, sync))
        return moved / timed(base.plain_copy, sync)

    paired = paired_rounds(ours, baseline, args.rounds)
    return Row(batch, moved, paired, gather, copy_s, other_s)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible; use --device cpu", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    print(command_line())
    print(f"# reproduce: {reproduce_command(args)}")
    print(environment())
    segments = -(-args.pages // args.segment_pages)
    storage = KVStorage(
        segments, args.segment_pages, args.page_size, args.layers, args.kv_heads,
        args.head_dim, DTYPES[args.dtype], device,
    )  # fmt: skip
    check_contents(args, storage, args.batch_sizes[0])
    _, first = defragment(args, storage, args.batch_sizes[0], sync)  # warm-up
    base = Baselines(storage, first.pages_moved, args.seed)
    timed(base.plain_copy, sync), timed(base.gather_copy, sync)  # warm-up
    moved = first.bytes_moved
    print(
        f"pool: {storage.num_pages} pages of {storage.bytes_per_page} B "
        f"({storage.nbytes / 2**20:.0f} MiB, {storage.num_segments} segments) on {device}; "
        f"fragmentation {first.fragmentation_before:.3f} before, "
        f"{first.fragmentation_after:.3f} after; "
        f"{first.pages_moved} pages moved = {moved / 2**20:.1f} MiB"
    )
    print(
        f"{args.rounds} paired rounds per batch size; each figure is the median (min-max) of the "
        "rounds, each ratio the median (min-max) of the per-round ratios"
    )
    header = (
        "batch_pages", "defrag_GB/s", "plain_GB/s", "gather_GB/s", "defrag/plain",
        "defrag/gather", "copy_pages/plain", "copy_ms", "other_ms",
    )  # fmt: skip
    widths = (11, 19, 19, 19, 16, 16, 16, 16, 16)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    rows = []
    for batch in args.batch_sizes:
        r = measure(args, storage, base, moved, batch, sync)
        rows.append(r)
        cells = (
            str(batch), spread(r.vs_plain.ours, 1e-9), spread(r.vs_plain.base, 1e-9),
            spread(r.gather, 1e-9), spread(r.vs_plain.ratios), spread(r.vs_gather.ratios),
            spread(r.copy_vs_plain.ratios), spread(r.copy_s, 1e3), spread(r.other_s, 1e3),
        )  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)), flush=True)
    best = max(rows, key=lambda r: r.vs_plain.median_ratio)
    print(
        f"best batch_pages {best.batch}: defrag/plain {best.vs_plain.ratio_summary()} "
        "(target >= 0.5). defrag/plain = defrag bytes/s over plain-copy bytes/s for the same "
        "bytes, in the same round; copy_pages/plain the same for the time inside "
        "KVStorage.copy_pages alone; copy_ms = time in copy_pages, other_ms = planning and "
        "page-table bookkeeping (measured in a second, otherwise identical defragmentation)"
    )
    print(load_average())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
