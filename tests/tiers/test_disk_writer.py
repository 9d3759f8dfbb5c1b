"""The disk tier's background writer: a queued page reads back before its file exists, a page
removed while queued leaves no file, failed writes are reported, and the queue's memory is
bounded (a store waits for room instead of growing it)."""

import gc
import shutil
import threading

import pytest
import torch

from kvctl.agent.tiers.disk_tier import DiskPageError, DiskSlots
from kvctl.agent.tiers.disk_writer import DiskWriter


class Disk:
    """Files in a dict, each write held until the test lets it through."""

    def __init__(self) -> None:
        self.files: dict[bytes, bytes] = {}
        self.gate = threading.Event()
        self.fail: set[bytes] = set()

    def write(self, digest: bytes, payload: bytes) -> None:
        self.gate.wait(10)
        if digest in self.fail:
            raise OSError(28, "No space left on device")
        self.files[digest] = payload

    def remove(self, digest: bytes) -> None:
        self.files.pop(digest, None)


def test_a_queued_page_reads_back_and_a_cancelled_one_leaves_no_file() -> None:
    disk = Disk()
    writer = DiskWriter(disk.write, disk.remove)
    writer.submit(b"a", b"A" * 10)
    writer.submit(b"b", b"B" * 10)
    assert writer.pending(b"a") == b"A" * 10 and disk.files == {}
    writer.cancel(b"b")
    disk.gate.set()
    writer.flush()
    assert disk.files == {b"a": b"A" * 10}
    assert writer.pending(b"a") is None


def test_failed_writes_are_reported_once() -> None:
    disk = Disk()
    disk.fail.add(b"x")
    disk.gate.set()
    writer = DiskWriter(disk.write, disk.remove)
    writer.submit(b"x", b"1")
    writer.submit(b"y", b"2")
    writer.flush()
    assert writer.take_failures() == [b"x"]
    assert writer.take_failures() == []
    assert disk.files == {b"y": b"2"}


def test_the_queue_holds_at_most_its_bytes() -> None:
    disk = Disk()
    writer = DiskWriter(disk.write, disk.remove, max_pending_bytes=15)
    writer.submit(b"a", b"A" * 10)
    second = threading.Thread(target=writer.submit, args=(b"b", b"B" * 10))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second page was queued beyond the bound"
    disk.gate.set()
    second.join(10)
    writer.flush()
    assert set(disk.files) == {b"a", b"b"}


def test_disk_slots_serve_a_page_before_and_after_its_file_is_written(tmp_path) -> None:
    slots = DiskSlots(tmp_path, (2, 2, 4, 1, 8), torch.float32)
    pages = torch.randn(3, 2, 2, 4, 1, 8)
    digests = [bytes([i]) * 16 for i in range(3)]
    assert slots.write(digests, pages) == [True, True, True]
    for digest, page in zip(digests, pages, strict=True):
        assert torch.equal(slots.read(digest), page)  # queued or written: the same bytes
    slots.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{d.hex()}.kvpage" for d in digests
    )
    for digest, page in zip(digests, pages, strict=True):
        assert torch.equal(slots.read(digest), page)
    slots.remove(digests[:1])
    assert len(list(tmp_path.iterdir())) == 2


def test_a_directory_replaced_by_a_file_fails_pages_without_raising(tmp_path) -> None:
    path = tmp_path / "tier"
    slots = DiskSlots(path, (1, 2, 4, 1, 8), torch.float32)
    digest = b"d" * 16
    slots.write([digest], torch.ones(1, 1, 2, 4, 1, 8))
    slots.flush()
    shutil.rmtree(path)
    path.write_text("not a directory")
    slots.remove([digest])  # an eviction at this moment must not take the agent down
    with pytest.raises(DiskPageError) as error:
        slots.read(digest)
    assert error.value.reason == "io"
    slots.write([b"e" * 16], torch.ones(1, 1, 2, 4, 1, 8))
    slots.flush()
    assert slots.take_failures() == [b"e" * 16]


def test_a_dropped_disk_tier_ends_its_writer_thread(tmp_path) -> None:
    slots = DiskSlots(tmp_path, (1, 2, 4, 1, 8), torch.float32)
    thread = slots._writer._thread
    assert thread.is_alive()
    del slots
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
