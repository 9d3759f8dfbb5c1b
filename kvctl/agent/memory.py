"""Giving memory back to the system after bursts of large requests (glibc hosts), without
making every forward pass pay for memory it gave back.

A burst of large bodies (150 prompts of 1 MB at once) leaves the agent's resident memory tens of
megabytes higher for good, although every buffer was freed: glibc serves them from its heap
arenas once its mmap threshold has risen (it raises it each time an mmapped block is freed, up to
32 MiB), and a heap fragmented by a burst is rarely returned by itself. So the agent asks malloc
to return the free parts of its arenas (`malloc_trim`) once it has been idle for a second, at
most once a second (`IdleTrim`): a gap of a few milliseconds between two waves of requests is not
idleness, and a trim there made the next wave's first step fault its activations in again.

It also fixes the mmap threshold at 64 MiB (which turns the raising off) and the trim threshold
at 128 MiB (`configure_malloc`). Blocks under the first come from the heap and are reused: a
forward pass allocates and frees the same activations in every layer (25 MB for the gate/up
product of a 2,048-token step of a 135M model), and served each from a fresh mapping, every one
paid its page faults and the kernel's zeroing again: decode steps at batch 32 and prefill waves
took 15-20 % longer with a 256 KiB threshold (docs/performance.md, "Where a decode step goes").
The second keeps a heap's free top instead of returning it at every free: fixing the mmap
threshold leaves the trim threshold at glibc's 128 KiB, and the engine thread's arena then gave
its activations back after each layer, about 100,000 page faults and a fifth of a 2,048-token
bfloat16 prompt step (docs/performance.md, "Page faults in a prompt step"). Blocks above 64 MiB,
the pool's segments among them, are mapped on their own and go back to the system when freed.

On other C libraries both are no-ops; nothing here is needed for correctness.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
"""glibc's own rule while it adjusts the thresholds itself: a heap keeps a free top of up to
twice the largest block it serves."""
IDLE_BEFORE_TRIM_S = 1.0
TRIM_INTERVAL_S = 1.0


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


def configure_malloc(
    mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES
) -> bool:
    """Serve blocks of `mmap_threshold` bytes and more with mmap for the life of the process, so
    freeing them returns them to the system, and let a heap keep a free top of up to
    `trim_threshold` bytes; True when the C library took both."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)
    )


def release_free_memory() -> bool:
    """Return the free parts of malloc's arenas to the system; True when some was returned."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


class IdleTrim:
    """When to trim: after `idle_s` seconds without work, at most every `interval_s`. `tick`
    is called on every pass of the engine loop with whether it had work."""

    def __init__(
        self, now: float, idle_s: float = IDLE_BEFORE_TRIM_S, interval_s: float = TRIM_INTERVAL_S
    ) -> None:
        self.idle_s, self.interval_s = idle_s, interval_s
        self.idle_since: float | None = None
        self.last_trim = now

    def tick(self, now: float, busy: bool) -> bool:
        """True when memory should be trimmed now."""
        if busy:
            self.idle_since = None
            return False
        if self.idle_since is None:
            self.idle_since = now
        if now - self.idle_since < self.idle_s or now - self.last_trim < self.interval_s:
            return False
        self.last_trim = now
        return True
