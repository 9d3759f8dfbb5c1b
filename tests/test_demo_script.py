"""`make demo` end to end, briefly: it runs without a terminal and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from local_tools import free_port

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not (ROOT / ".venv/bin/kvctl").exists(), reason="needs `make setup`")
def test_demo_runs_headless_and_cleans_up(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KVCTL_DEMO_SECONDS": "3",
        "KVCTL_DEMO_PORT": str(free_port()),
        "TMPDIR": str(tmp_path),
    }
    done = subprocess.run(
        ["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kvctl load: chat" in done.stdout
    assert list(tmp_path.iterdir()) == []  # the logs folder is gone after a clean run
