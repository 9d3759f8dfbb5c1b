"""Page files under a directory: the tier below host memory.

One file per page, named by its digest: a 48-byte header (magic, the page's digest, a BLAKE2b
checksum of the contents, their length) and the page's bytes. A file is written to a temporary
name and renamed, so a crash leaves a whole file or none; a read checks the length, the digest
and the checksum, and anything else (missing, truncated, another page's, altered) is a miss that
is counted and never wrong K/V. Files are written by a background thread (`DiskWriter`), so a
store costs the engine a memcpy, not a disk write. Files left by an earlier run are removed at
start: a checkpoint replaced under the same name and shape must not be served from them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import weakref
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from kvctl.agent.tiers.disk_writer import DiskWriter

MAGIC = b"KVCTLKV1"
SUFFIX = ".kvpage"
_HEADER = struct.Struct("<8s16s16sQ")

LOAD_FAILURES = ("missing", "truncated", "checksum", "io")


class DiskPageError(Exception):
    """A page file that cannot be used; `reason` is one of `LOAD_FAILURES`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class DiskSlots:
    """Page files in one directory, written and read by digest."""

    name = "disk"

    def __init__(
        self,
        path: Path,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        background: bool = True,
    ) -> None:
        self.path = Path(path)
        self.page_shape = page_shape
        self.dtype = dtype
        self.page_bytes = dtype.itemsize * int(torch.Size(page_shape).numel())
        self.file_bytes = _HEADER.size + self.page_bytes
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"--disk-tier-path {self.path} exists and is not a directory")
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)  # K/V is the users' data
            for stale in (*self.path.glob(f"*{SUFFIX}"), *self.path.glob(f"*{SUFFIX}.tmp")):
                stale.unlink(missing_ok=True)
            probe = self.path / f".probe{SUFFIX}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise ValueError(f"--disk-tier-path {self.path}: {error.strerror}") from None
        self._writer = None
        if background:  # the thread holds the directory, not this object, so it is collected
            writer = DiskWriter(
                partial(write_page_file, self.path), partial(remove_page_file, self.path)
            )
            weakref.finalize(self, writer.close)
            self._writer = writer

    def file_of(self, digest: bytes) -> Path:
        return page_file(self.path, digest)

    def write(self, digests: list[bytes], data: Tensor) -> list[bool]:
        """Write each page's file; returns which were written. In the background (the default)
        this only copies the bytes out and queues them, every page counts as written, and a
        write that fails later is reported by `take_failures`; otherwise an OSError (a full
        disk, a directory gone) fails that page here."""
        host = data.detach().to("cpu").contiguous()
        raw = host.view(torch.uint8).reshape(len(digests), -1).numpy()
        written = []
        for digest, row in zip(digests, raw, strict=True):
            payload = row.tobytes()
            if self._writer is not None:
                self._writer.submit(digest, payload)
                written.append(True)
                continue
            try:
                write_page_file(self.path, digest, payload)
                written.append(True)
            except OSError:
                written.append(False)
        return written

    def take_failures(self) -> list[bytes]:
        """Pages whose background write failed since the last call (to forget and count)."""
        return self._writer.take_failures() if self._writer is not None else []

    def flush(self) -> None:
        """Wait until every queued page is on disk (or has failed)."""
        if self._writer is not None:
            self._writer.flush()

    def read(self, digest: bytes) -> Tensor:
        """The page of `digest`, `[*page_shape]` on the host; `DiskPageError` when the file is
        missing, truncated, another page's or altered."""
        if self._writer is not None:
            queued = self._writer.pending(digest)
            if queued is not None:  # not written yet: the bytes are still in memory
                flat = torch.frombuffer(bytearray(queued), dtype=torch.uint8)
                return flat.view(self.dtype).reshape(self.page_shape)
        target = self.file_of(digest)
        try:
            blob = target.read_bytes()
        except FileNotFoundError:
            raise DiskPageError("missing", f"{target} is gone") from None
        except OSError as e:
            raise DiskPageError("io", f"{target}: {e.strerror}") from None
        if len(blob) != self.file_bytes:
            raise DiskPageError("truncated", f"{target} has {len(blob)} bytes")
        magic, stored, checksum, length = _HEADER.unpack_from(blob)
        payload = memoryview(blob)[_HEADER.size :]
        if magic != MAGIC or stored != digest or length != self.page_bytes:
            raise DiskPageError("checksum", f"{target} holds another page")
        if hashlib.blake2b(payload, digest_size=16).digest() != checksum:
            raise DiskPageError("checksum", f"{target} fails its checksum")
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(self.dtype).reshape(self.page_shape)

    def remove(self, digests: list[bytes]) -> None:
        """Delete pages' files (and cancel their queued writes); a directory that is gone or
        unreadable is not an error here: the pages are forgotten either way."""
        for digest in digests:
            if self._writer is not None:
                self._writer.cancel(digest)
            remove_page_file(self.path, digest)

    def filesystem(self) -> tuple[int, int] | None:
        """(free bytes, size bytes) of the filesystem holding the directory; None when it
        cannot be read (the directory is gone)."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def page_file(directory: Path, digest: bytes) -> Path:
    return directory / f"{digest.hex()}{SUFFIX}"


def write_page_file(directory: Path, digest: bytes, payload: bytes) -> None:
    """Checksum and write one page's file under a temporary name, then rename it (an OSError
    leaves no file behind)."""
    checksum = hashlib.blake2b(payload, digest_size=16).digest()
    header = _HEADER.pack(MAGIC, digest, checksum, len(payload))
    target = page_file(directory, digest)
    temporary = target.with_name(target.name + ".tmp")
    try:
        with open(temporary, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(temporary, target)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise


def remove_page_file(directory: Path, digest: bytes) -> None:
    with contextlib.suppress(OSError):  # gone already, or the directory is
        page_file(directory, digest).unlink(missing_ok=True)
