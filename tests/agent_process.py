"""Start and stop real `kvctl-agent` processes for integration tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

AGENT_START_TIMEOUT_S = 90.0
SMALL_POOL = ("--pool-pages", "256", "--segment-pages", "32", "--page-size", "16")


@dataclass
class RunningAgent:
    """A `kvctl-agent` process started by a test, on a free loopback port."""

    process: subprocess.Popen
    url: str
    token: str | None
    log: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def launch_agent(
    *args: str, token: str | None = None, tmp: Path | None = None, file_limit: int | None = None
) -> RunningAgent:
    """Start `kvctl-agent --port 0 ...` and wait for its `listening on` line; `file_limit`
    sets its soft and hard limit on open files (as a unit's LimitNOFILE= does)."""
    cmd = [sys.executable, "-m", "kvctl.agent.startup.main", "--port", "0", *args]
    if token is not None:
        assert tmp is not None
        token_file = tmp / "token"
        token_file.write_text(token)
        cmd += ["--token-file", str(token_file)]
    process = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=None if file_limit is None else lambda: _limit_files(file_limit),
    )
    agent = RunningAgent(process, "", token)
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            agent.log.append(line.rstrip())
            if "listening on http://" in line and not ready.is_set():
                agent.url = line.split("listening on ", 1)[1].split()[0]
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + AGENT_START_TIMEOUT_S
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("kvctl-agent did not start:\n" + "\n".join(agent.log))
    if not agent.url:
        process.wait(10)
        raise RuntimeError("kvctl-agent exited:\n" + "\n".join(agent.log))
    return agent


def _limit_files(count: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))


def refused_at_start(*flags: str) -> str:
    """Start `kvctl-agent` with `flags`, which it must refuse: its one error line (exit 2)."""
    result = subprocess.run(
        [sys.executable, "-m", "kvctl.agent.startup.main", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "level=" not in line]
    assert len(errors) == 1 and errors[0].startswith("kvctl-agent: error: "), result.stderr
    return errors[0]
