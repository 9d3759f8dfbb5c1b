"""Giving memory back to the system after bursts of large requests (glibc hosts).

A burst of large bodies (150 prompts of 1 MB at once) leaves the agent's resident memory tens of
megabytes higher for good, although every buffer was freed: glibc serves blocks of 128 KiB and
more with mmap, but raises that threshold each time such a block is freed (up to 32 MiB), after
which request bodies, parsed JSON strings and token lists come from the heap arenas, and a heap
fragmented by a burst is rarely returned. So the agent fixes the threshold (which also turns the
raising off): large blocks stay in mmap and go back to the system when freed. And after a burst,
once idle, it asks malloc to return the free parts of its arenas (`malloc_trim`).

On other C libraries both are no-ops; nothing here is needed for correctness.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameters, from glibc's malloc.h
MMAP_THRESHOLD_BYTES = 256 * 1024


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
