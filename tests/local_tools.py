"""What tests need from this machine: the Prometheus tools (Debian packages) and free ports."""

from __future__ import annotations

import os
import shutil
import socket

import pytest

BINARIES: dict[str, tuple[str, ...]] = {
    "promtool": ("promtool",),
    "prometheus": ("prometheus",),
    "alertmanager": ("alertmanager", "prometheus-alertmanager"),  # Debian names it the latter
    "amtool": ("amtool",),
}


def find_binary(name: str) -> str:
    """The path of a Prometheus tool; fails under CI and skips elsewhere when it is missing."""
    for candidate in BINARIES[name]:
        path = shutil.which(candidate)
        if path:
            return path
    message = (
        f"{name} is not installed: `apt-get install prometheus prometheus-alertmanager` "
        "(.ci/run does it)"
    )
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    """A loopback port free now, for a process that must know its port before it starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
