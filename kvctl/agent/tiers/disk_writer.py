"""Page files written by a background thread, so storing to disk does not stall engine steps.

The engine thread only copies a page's bytes out of the tensor (a memcpy) and queues them; the
writer thread checksums and writes them (`hashlib` and file writes release the GIL, so this runs
beside the model's forward). Until its file is written a page is *pending*: reads are served from
the queued bytes, and removing it cancels the write (a file the writer finishes for a page that
was removed meanwhile is deleted). The queue holds at most `max_pending_bytes`; a store beyond
that waits for room, so memory stays bounded and a disk slower than the evictions shows up as
store time rather than as lost pages. Failed writes are collected for the store to count and
forget (`take_failures`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class PendingPage:
    digest: bytes
    payload: bytes


class DiskWriter:
    """One thread writing queued pages with `write_file(digest, payload)` (raises OSError)."""

    def __init__(
        self,
        write_file: Callable[[bytes, bytes], None],
        remove_file: Callable[[bytes], None],
        max_pending_bytes: int = 256 << 20,
    ) -> None:
        self._write_file = write_file
        self._remove_file = remove_file
        self._max_pending = max_pending_bytes
        self._pending: dict[bytes, PendingPage] = {}
        self._pending_bytes = 0
        self._failures: list[bytes] = []
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._queue: queue.Queue[PendingPage | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvctl-disk-tier", daemon=True)
        self._thread.start()

    def submit(self, digest: bytes, payload: bytes) -> None:
        """Queue a page's file; waits while the queue holds `max_pending_bytes` already."""
        job = PendingPage(digest, payload)
        with self._room:
            while self._pending_bytes and self._pending_bytes + len(payload) > self._max_pending:
                self._room.wait()
            old = self._pending.get(digest)
            if old is not None:
                self._pending_bytes -= len(old.payload)
            self._pending[digest] = job
            self._pending_bytes += len(payload)
        self._queue.put(job)

    def pending(self, digest: bytes) -> bytes | None:
        """The queued bytes of a page whose file is not written yet."""
        with self._lock:
            job = self._pending.get(digest)
            return job.payload if job is not None else None

    def cancel(self, digest: bytes) -> None:
        """Forget a queued page (its file, if the writer gets to it, is deleted)."""
        with self._room:
            job = self._pending.pop(digest, None)
            if job is not None:
                self._pending_bytes -= len(job.payload)
                self._room.notify_all()

    def take_failures(self) -> list[bytes]:
        """Digests whose write failed since the last call."""
        with self._lock:
            failed, self._failures = self._failures, []
            return failed

    def flush(self) -> None:
        """Wait until every queued page is written (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Let the thread end once what is queued is written (when the tier is dropped)."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(job)
            finally:
                self._queue.task_done()

    def _write(self, job: PendingPage) -> None:
        with self._lock:
            current = self._pending.get(job.digest) is job
        if not current:
            return
        try:
            self._write_file(job.digest, job.payload)
            failed = False
        except OSError:
            failed = True
        with self._room:
            if self._pending.get(job.digest) is job:
                del self._pending[job.digest]
                self._pending_bytes -= len(job.payload)
                self._room.notify_all()
                if failed:
                    self._failures.append(job.digest)
            elif not failed:  # removed while it was being written
                self._remove_file(job.digest)
