"""Resident memory before and after shrinking a CPU pool from 1024 to 192 pages.

The pool has a 135M Llama's KV shape (30 layers, 3 KV heads, head dim 64, float32, 16-token
pages: 720 KiB a page, 720 MiB in all); a shrink to 192 pages frees 585 MiB. Each case runs in
a fresh interpreter, under one of two malloc settings: the agent's (`configure_malloc`, a
64 MiB mmap threshold and a 128 MiB trim threshold, set at start-up) and glibc's own after
importing torch (its threshold is raised towards 32 MiB as large blocks are freed), and with or
without the trim that
`KVStorage.release_segments` does on the CPU.

    python benchmarks/shrink_rss.py [--segment-pages 1 16 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CASE = """
import json, sys, time
import torch
from kvctl.agent import memory
from kvctl.agent.pool import storage as module

def rss():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024

segment_pages, malloc, trim = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "trim"
if malloc == "agent":
    memory.configure_malloc()
if not trim:
    module.release_free_memory = lambda: False
torch.set_num_threads(1)
kv = module.KVStorage(1024 // segment_pages, segment_pages, 16, 30, 3, 64)
kv.fill_pages(range(kv.num_pages), 1.0)
before = rss()
start = time.perf_counter()
kv.release_segments((1024 - 192) // segment_pages)
seconds = time.perf_counter() - start
after = rss()
freed = (1024 - 192) * kv.bytes_per_page
print(json.dumps({"before": before, "after": after, "freed": freed, "seconds": seconds}))
"""


def measure(segment_pages: int, malloc: str, trim: str) -> dict[str, float]:
    run = subprocess.run(
        [sys.executable, "-c", _CASE, str(segment_pages), malloc, trim],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(run.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segment-pages", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    mib = 2**20
    print("segment   malloc  trim     RSS before  RSS after  dropped  of freed  release")
    for segment_pages in args.segment_pages:
        for malloc in ("agent", "glibc"):
            for trim in ("trim", "no-trim"):
                r = measure(segment_pages, malloc, trim)
                dropped = r["before"] - r["after"]
                print(
                    f"{segment_pages * 720:>6} KiB {malloc:>7} {trim:>7} "
                    f"{r['before'] / mib:>9.0f} MiB {r['after'] / mib:>6.0f} MiB "
                    f"{dropped / mib:>5.0f} MiB {dropped / r['freed']:>8.0%} "
                    f"{r['seconds'] * 1e3:>6.1f} ms"
                )


if __name__ == "__main__":
    main()
