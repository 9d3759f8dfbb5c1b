"""A CPU kernel build killed halfway leaves torch's lock file; the next start must not wait for
it (it did: the agent hung after its pool line, silently, and with the age rule that followed,
for ten minutes after an agent was stopped during its first start)."""

from __future__ import annotations

import fcntl
import logging
import threading

from kvctl.agent import kernels
from kvctl.agent.kernels import build_lock


def test_a_lock_left_by_a_killed_build_is_removed_however_fresh(tmp_path, caplog) -> None:
    (tmp_path / "lock").touch()  # torch's lock, of a build that died just now
    with caplog.at_level(logging.WARNING), build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "did not finish" in caplog.text


def test_a_build_in_progress_is_waited_for_and_its_lock_left_alone(tmp_path, caplog) -> None:
    """While another holder has the directory, its torch lock is its own: nothing is removed
    until it lets go, and only then does this one go on."""
    order: list[str] = []
    holding, may_release = threading.Event(), threading.Event()

    def other_build() -> None:
        with open(tmp_path / "build.flock", "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            (tmp_path / "lock").touch()
            holding.set()
            may_release.wait(10)
            (tmp_path / "lock").unlink()  # a build that finishes removes its lock
            order.append("other done")
            fcntl.flock(handle, fcntl.LOCK_UN)

    thread = threading.Thread(target=other_build)
    thread.start()
    assert holding.wait(10)
    threading.Timer(0.2, may_release.set).start()
    with caplog.at_level(logging.INFO), build_lock(tmp_path):
        order.append("this one")
        assert (tmp_path / "build.flock").exists()
    thread.join()
    assert order == ["other done", "this one"]
    assert "another process is building" in caplog.text
    assert "did not finish" not in caplog.text


def test_no_lock_is_nothing_to_do(tmp_path) -> None:
    with build_lock(tmp_path):
        pass


def test_two_checkouts_of_the_same_source_build_apart(tmp_path) -> None:
    """ninja's build line names the source's path: two checkouts sharing one cache would rebuild
    the kernels for each other on every start if they shared a build directory."""
    first, second = tmp_path / "a" / "cpu_ops.cpp", tmp_path / "b" / "cpu_ops.cpp"
    for copy in (first, second):
        copy.parent.mkdir()
        copy.write_bytes(kernels.SOURCE.read_bytes())
    torch_dir = tmp_path / "torch"
    assert kernels.build_name(first, "2.13.0", torch_dir) != kernels.build_name(
        second, "2.13.0", torch_dir
    )
    assert kernels.build_name(first, "2.13.0", torch_dir) == kernels.build_name(
        first, "2.13.0", torch_dir
    )
    assert kernels.build_name(first, "2.13.0", torch_dir) != kernels.build_name(
        first, "2.13.1", torch_dir
    )
