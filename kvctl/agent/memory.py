"""Giving memory back to the system after bursts of large requests (glibc hosts).

A burst of large bodies (150 prompts of 1 MB at once) leaves the agent's resident memory tens of
megabytes higher for good, although every buffer was freed: glibc serves them from its heap
arenas once its mmap threshold has risen (it raises it each time an mmapped block is freed, up to
32 MiB), and a heap fragmented by a burst is rarely returned by itself. So the agent asks malloc
to return the free parts of its arenas (`malloc_trim`) whenever it is idle, at most once a
second.

It also fixes the threshold at 64 MiB (which turns the raising off). Blocks under it come from
the heap and are reused: a forward pass allocates and frees the same activations in every layer
(25 MB for the gate/up product of a 2,048-token step of a 135M model), and served each from a
fresh mapping, every one paid its page faults and the kernel's zeroing again: decode steps at
batch 32 and prefill waves took 15-20 % longer with a 256 KiB threshold (docs/performance.md,
"Where a decode step goes"). Blocks above it, the pool's segments among them, are mapped on
their own and go back to the system when freed.

On other C libraries both are no-ops; nothing here is needed for correctness.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameters, from glibc's malloc.h
MMAP_THRESHOLD_BYTES = 64 << 20


@cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc only: other libcs raise here)
    except (OSError, AttributeError):
        return None
    return libc


def keep_large_blocks_in_mmap(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve blocks of `threshold` bytes and more with mmap for the life of the process, so
    freeing them returns them to the system; True when the C library took it."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, threshold))


def release_free_memory() -> bool:
    """Return the free parts of malloc's arenas to the system; True when some was returned."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))
