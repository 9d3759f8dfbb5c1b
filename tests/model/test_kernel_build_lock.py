"""A CPU kernel build killed halfway leaves torch's lock file; the next start must not wait for
it forever (it did: the agent hung after its pool line, silently)."""

from __future__ import annotations

import logging
import os
import time

from kvctl.agent.kernels import BUILD_LOCK_STALE_S, clear_stale_lock


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path, caplog) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - BUILD_LOCK_STALE_S - 1
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING):
        clear_stale_lock(lock)
    assert not lock.exists()
    assert "did not finish" in caplog.text


def test_a_fresh_lock_is_another_build_and_is_left_alone(tmp_path, caplog) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    with caplog.at_level(logging.INFO):
        clear_stale_lock(lock)
    assert lock.exists()
    assert "another process is building" in caplog.text


def test_no_lock_is_nothing_to_do(tmp_path) -> None:
    clear_stale_lock(tmp_path / "lock")
