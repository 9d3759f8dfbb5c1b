"""Defragmentation throughput against a plain copy of the same bytes on the same device.

A defragmentation moves pages: plan, copy contents (`KVStorage.copy_pages`), switch page tables.
Its cost floor is the copy, so the honest yardstick is the device's own copy bandwidth, measured
in the same run: a contiguous `dst.copy_(src)` of as many bytes as the defragmentation moved, and
an `index_select` gather of as many whole pages (what a scattered copy costs without any
bookkeeping). The ratio defrag / plain copy says how much of the device's bandwidth a
defragmentation gets; the split between time in `copy_pages` and the rest says whether the copy
or the pool's bookkeeping (planning, relocation) is the bottleneck.

The pool is fragmented by a seeded churn of allocations and frees of random lengths, rebuilt
identically before every repetition; each figure is the median over the repetitions, with the
plain copies interleaved between the defragmentations so that a noisy machine shifts both alike.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvctl.agent.pool.defrag import Defragmenter, DefragReport, DefragTrigger
from kvctl.agent.pool.page_pool import PagePool
from kvctl.agent.pool.storage import KVStorage

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
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_pages.split(",")]
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The full command line, every option spelled out, so changed defaults do not matter."""
    options = [
        "--device", args.device, "--pages", args.pages, "--segment-pages", args.segment_pages,
        "--page-size", args.page_size, "--layers", args.layers, "--kv-heads", args.kv_heads,
        "--head-dim", args.head_dim, "--dtype", args.dtype, "--max-seq-pages", args.max_seq_pages,
        "--fill", args.fill, "--batch-pages", args.batch_pages, "--repeats", args.repeats,
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
    assert report.complete and report.fragmentation_after == 0.0
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
    batch: int
    defrag_s: float
    plain_s: float
    gather_s: float
    copy_s: float  # of a defragmentation, time inside copy_pages
    other_s: float  # of a defragmentation, the rest: planning and page-table bookkeeping


def measure(
    args: argparse.Namespace, storage: KVStorage, base: Baselines, sync: Callable[[], None]
) -> list[Row]:
    """Medians over `--repeats` rounds; each round runs every batch size and the baselines, so
    a burst of load from elsewhere on the machine hits all of them alike."""
    names = ("defrag", "plain", "gather", "copy", "other")  # the order of Row's fields
    samples = {batch: {name: [] for name in names} for batch in args.batch_sizes}
    for _ in range(args.repeats):
        for batch, sample in samples.items():
            sample["defrag"].append(defragment(args, storage, batch, sync)[0])
            sample["plain"].append(timed(base.plain_copy, sync))
            sample["gather"].append(timed(base.gather_copy, sync))
            copier = TimedCopier(storage, sync)
            seconds, _ = defragment(args, copier, batch, sync)
            sample["copy"].append(copier.seconds)
            sample["other"].append(seconds - copier.seconds)
    return [
        Row(batch, *(statistics.median(sample[name]) for name in names))
        for batch, sample in samples.items()
    ]


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

    print(f"# {reproduce_command(args)}")
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start"
    )
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
        f"fragmentation {first.fragmentation_before:.3f} before, 0 after; "
        f"{first.pages_moved} pages moved = {moved / 2**20:.1f} MiB"
    )
    print(
        f"{'batch_pages':>11} {'defrag_ms':>9} {'defrag_GB/s':>11} {'plain_GB/s':>10} "
        f"{'gather_GB/s':>11} {'defrag/plain':>12} {'defrag/gather':>13} "
        f"{'copy_ms':>8} {'other_ms':>8}"
    )
    rows = measure(args, storage, base, sync)
    for r in rows:
        print(
            f"{r.batch:>11} {r.defrag_s * 1e3:>9.2f} {gbps(moved, r.defrag_s):>11.2f} "
            f"{gbps(moved, r.plain_s):>10.2f} {gbps(moved, r.gather_s):>11.2f} "
            f"{r.plain_s / r.defrag_s:>12.2f} {r.gather_s / r.defrag_s:>13.2f} "
            f"{r.copy_s * 1e3:>8.2f} {r.other_s * 1e3:>8.2f}"
        )
    best = max(rows, key=lambda r: r.plain_s / r.defrag_s)
    print(
        f"best batch_pages {best.batch}: defrag/plain {best.plain_s / best.defrag_s:.2f} "
        "(target >= 0.5). defrag/plain = plain-copy seconds / defrag seconds for the same bytes; "
        "copy_ms = time in KVStorage.copy_pages, other_ms = planning and page-table bookkeeping "
        "(measured in separate, otherwise identical runs)"
    )
    return 0


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9


if __name__ == "__main__":
    raise SystemExit(main())
