"""kvctl.alerts is imported by the CLI, so it must load without torch or the agent."""

from __future__ import annotations

import subprocess
import sys


def test_importing_alerts_loads_neither_torch_nor_the_agent() -> None:
    code = (
        "import sys, kvctl.alerts, kvctl.alerts.alertmanager, kvctl.alerts.rules; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvctl.agent')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
