"""`make demo` end to end without a terminal: the story happens in order, each step's numbers move
the way the step says, the status table after it shows what the story ended on, and nothing is
left behind: no process, and no folder after a clean run (a failed or interrupted run keeps its
folder and names it)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from local_tools import free_port

ROOT = Path(__file__).resolve().parent.parent
DEMO = ["bash", "scripts/demo.sh"]
LABELS = [
    "traffic rises",
    "alert fires",
    "fix",
    "grow on demand",
    "fragmentation builds",
    "defrag",
    "alert resolves",
]
STEP = re.compile(r"^step (\d)/7  ([a-z ]+): (.+?)   (.+)$", re.MULTILINE)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not (ROOT / ".venv/bin/kvctl").exists(), reason="needs `make setup`"),
]


def demo_env(tmp_path: Path, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVCTL_AGENT", "KVCTL_TOKEN")}
    return {**env, "KVCTL_DEMO_PORT": str(port), "TMPDIR": str(tmp_path), **extra}


def running_in(folder: Path) -> list[str]:
    """Processes whose working directory is inside `folder` (the demo starts everything in its
    temporary folder), as "pid command"."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(proc / "cwd"))
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if cwd.is_relative_to(folder.resolve()):
            found.append(f"{proc.name} {command}")
    return found


def kept_folder(stderr: str, tmp_path: Path) -> Path:
    found = re.search(r"kvctl demo: logs kept in (\S+)", stderr)
    assert found, stderr
    folder = Path(found.group(1))
    assert folder.parent == tmp_path and (folder / "agent.log").exists()
    return folder


def arrow(numbers: str, label: str, unit: str = "") -> tuple[float, float]:
    """X and Y of `LABEL X → Y` in a step's numbers (`X % → Y %` with unit " %")."""
    number = r"([\d.]+)" + re.escape(unit)
    found = re.search(f"{re.escape(label)} {number} → {number}", numbers)
    assert found, f"no {label!r} X{unit} → Y{unit} in {numbers!r}"
    return float(found.group(1)), float(found.group(2))


def test_demo_tells_the_story_headless_and_cleans_up(tmp_path: Path) -> None:
    port = free_port()
    env = demo_env(tmp_path, port, KVCTL_DEMO_SECONDS="1", COLUMNS="220")  # alerts uncut
    done = subprocess.run(DEMO, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    steps = {label: (command, numbers) for _, label, command, numbers in STEP.findall(out)}
    assert [int(n) for n, *_ in STEP.findall(out)] == list(range(1, 8)), out
    assert list(steps) == LABELS, out

    # 1. traffic rises until page allocations fail
    command, numbers = steps["traffic rises"]
    assert command.startswith("kvctl load --profile random-lengths")
    quiet, short = arrow(numbers, "alloc success", " %")
    failed = re.search(r"\((\d+) of (\d+) page allocations failed\)", numbers)
    assert quiet == 100.0 > short and failed and int(failed.group(1)) >= 3, numbers

    # 2. the alert fires where the operator looks, with its cause and the command that fixes it
    alertmanager = shutil.which("alertmanager") or shutil.which("prometheus-alertmanager")
    where = "in Alertmanager" if alertmanager else "in the agent's alert list"
    command, numbers = steps["alert fires"]
    assert command.startswith("kvctl alerts list")
    assert re.match(
        rf"KvctlAllocationFailures \((warning|critical)\) none → firing {where}", numbers
    )
    why = re.search(r"^ +why: (.+)$", out, re.MULTILINE)
    fix = re.search(r"^ +fix: (.+)$", out, re.MULTILINE)
    assert why and "page allocations" in why.group(1) and "failed" in why.group(1), out
    runbook = re.search(r"^ +runbook: (\S+)$", out, re.MULTILINE)
    assert runbook and runbook[1] == f"http://127.0.0.1:{port}/runbook#kvctlallocationfailures"
    assert fix, out
    named = re.search(rf"`kvctl --agent http://127.0.0.1:{port} pool resize --pages (\d+)`", fix[1])
    assert named, fix[1]

    # 3. that command grows the pool to the size the alert named
    command, numbers = steps["fix"]
    assert command == f"kvctl pool resize --pages {named.group(1)} --yes"
    old, new = arrow(numbers, "capacity")
    assert new == int(named.group(1)) > old

    # 4. automatic growth takes it further, until the pool holds the load
    command, numbers = steps["grow on demand"]
    assert command.startswith("kvctl config set resize.enabled=true")
    grown_from, grown_to = arrow(numbers, "capacity")
    assert grown_from == new < grown_to
    assert "no allocation failed and no request preempted" in numbers

    # 5. and 6. fragmentation rises with auto-defrag off, and `kvctl defrag --now` brings it down
    command, numbers = steps["fragmentation builds"]
    assert command == "kvctl config set defrag.enabled=false"
    calm, fragmented = arrow(numbers, "fragmentation")
    assert calm < fragmented
    command, numbers = steps["defrag"]
    assert command == "kvctl defrag --now"
    before, after = arrow(numbers, "fragmentation")
    assert before == fragmented and after < before
    assert "auto-defrag back on: kvctl config set defrag.enabled=true" in numbers

    # 7. the alert resolves: allocation success is back to 100 % under the same traffic
    command, numbers = steps["alert resolves"]
    assert re.match(f"KvctlAllocationFailures firing → resolved {where}", numbers)
    assert arrow(numbers, "alloc success", " %")[1] == 100.0
    assert "no alert left at the agent" in numbers
    running = re.search(r"requests in flight (\d+)$", numbers)
    assert running and int(running[1]) > 0, numbers
    assert "no alert is pending or firing" in out

    # then the headless status table says the same: every allocation served, no alert firing
    table = out.split("kvctl top ·")[1].split("kvctl load: random-lengths")[0]
    [row] = [line for line in table.splitlines() if f"http://127.0.0.1:{port} " in line]
    assert " 100.00 % " in row, table
    shown = re.findall(r"(Kvctl\w+)( \(pending\))?", table)
    assert all(pending for _, pending in shown), table

    # and the load report, and nothing is left behind
    assert "kvctl load: random-lengths" in out
    assert running_in(tmp_path) == []
    assert list(tmp_path.iterdir()) == []  # the work folder is gone after a clean run


def test_demo_that_cannot_start_keeps_and_names_its_logs(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = demo_env(tmp_path, taken.getsockname()[1])
        done = subprocess.run(DEMO, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Address already in use" in done.stderr and "KVCTL_DEMO_PORT=8478" in done.stderr
    kept_folder(done.stderr, tmp_path)
    assert running_in(tmp_path) == []


def test_ctrl_c_stops_everything_the_demo_started(tmp_path: Path) -> None:
    port = free_port()
    env = demo_env(tmp_path, port)
    demo = subprocess.Popen(
        DEMO, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and demo.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert demo.poll() is None, demo.communicate()
        assert len(running_in(tmp_path)) >= 1  # the agent (and Alertmanager when installed)
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, out + err
    assert "interrupted" in err
    kept_folder(err, tmp_path)
    assert running_in(tmp_path) == []
