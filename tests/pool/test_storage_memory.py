"""A CPU shrink gives the freed segments back to the system, whatever malloc's settings.

Measured in a fresh interpreter (resident memory of this one depends on every test before it),
in the worst case for glibc: an mmap threshold of 32 MiB, where glibc's own raising of it ends,
so every segment below that is carved out of the heap rather than mapped on its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads VmRSS from /proc/self/status"
)

# 256 pages of a 135M Llama's KV shape (30 layers, 3 KV heads, head dim 64, float32, 16-token
# pages: 720 KiB each) in 11 MiB segments; shrinking to 48 pages frees 146 MiB.
_SHRINK = """
import ctypes, ctypes.util, json, sys
import torch
from kvctl.agent.pool import storage as module

def rss():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024

libc = ctypes.CDLL(ctypes.util.find_library("c"))
if not libc.mallopt(-3, 32 << 20):  # M_MMAP_THRESHOLD
    print(json.dumps(None))
    sys.exit()
if sys.argv[1] == "no-trim":
    module.release_free_memory = lambda: False
torch.set_num_threads(1)
kv = module.KVStorage(16, 16, 16, 30, 3, 64)
kv.fill_pages(range(kv.num_pages), 1.0)
before = rss()
kv.release_segments(13)
print(json.dumps({"dropped": before - rss(), "freed": 13 * 16 * kv.bytes_per_page}))
"""


def shrink(mode: str) -> dict[str, int]:
    run = subprocess.run(
        [sys.executable, "-c", _SHRINK, mode], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    if figures is None:
        pytest.skip("not glibc: no mallopt to set the mmap threshold")
    return figures


def test_resident_memory_drops_by_the_freed_segments_after_a_shrink() -> None:
    figures = shrink("trim")
    assert figures["dropped"] >= 0.9 * figures["freed"], figures


def test_without_the_trim_heap_segments_stay_resident() -> None:
    """The case the trim is for: shows the measurement above can fail."""
    figures = shrink("no-trim")
    assert figures["dropped"] < 0.5 * figures["freed"], figures
