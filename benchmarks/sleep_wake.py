"""Sleeping and waking a model on a real agent: wake latency per level, and memory returned.

A `kvctl-agent` process serves two models under one KV budget: the one put to sleep (the demo
model, or a SmolLM2-135M-shaped checkpoint read from disk, built by
benchmarks/smollm_checkpoint.py) and a small demo model that stays awake (the last awake model
is never put to sleep without `force`). Each round, for each level in turn (the order alternates
between rounds): a one-token completion to the awake model is timed; the agent's resident memory
is read; the model sleeps (`POST /v1/pools/M/sleep`) and the memory is read again; then the
same completion, which now wakes the model first, is timed, and the agent's own measure of the
wake (`sleep.last_wake_seconds`, what `kvctl_model_wake_seconds` observes) is read.

Per level: the wake as the agent measures it, the woken request's time and the awake request's
time (median, min-max over the rounds), the KV and weight bytes the sleep released, and how much
of it left the process's resident memory.

    python benchmarks/sleep_wake.py [--model demo|135m] [--rounds 7] [--kv-budget 1GiB]
        [--dtype auto|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from paired import command_line, environment, load_average, spread

LEVELS = (1, 2)
PROMPT = "the operator put the model to sleep and a request woke it " * 3


def start_agent(model: str, budget: str, dtype: str) -> tuple[subprocess.Popen[str], str]:
    """`kvctl-agent` serving `sleeper` (`model`) and `keeper` (a small demo model)."""
    cmd = [
        sys.executable,
        *("-m", "kvctl.agent.startup.main", "--port", "0"),
        *("--model", f"sleeper={model}", "--model", "keeper=demo:2x2"),
        *("--kv-budget", budget, "--dtype", dtype),
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if "listening on http://" in line and not ready.is_set():
                found.append(line.split("listening on ", 1)[1].split()[0])
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(300) or not found:
        process.kill()
        raise SystemExit("kvctl-agent did not start")
    return process, found[0]


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def complete(http: httpx.Client) -> float:
    body = {"model": "sleeper", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    answer = http.post("/v1/completions", json=body)
    answer.raise_for_status()
    return time.perf_counter() - started


def one_round(http: httpx.Client, pid: int, level: int) -> dict[str, float]:
    awake = min(complete(http) for _ in range(3))
    before = rss(pid)
    slept = http.post("/v1/pools/sleeper/sleep", json={"level": level})
    slept.raise_for_status()
    time.sleep(0.5)  # the trim runs with the release; give the kernel a moment
    after = rss(pid)
    woken = complete(http)
    state = http.get("/v1/pools/sleeper").json()["sleep"]
    assert state["state"] == "awake", state
    released = slept.json()
    return {
        "awake_s": awake,
        "woken_s": woken,
        "wake_s": state["last_wake_seconds"],
        "kv_bytes": released["kv_bytes"],
        "weights_bytes": released["weights_bytes"],
        "rss_drop": before - after,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("demo", "135m"), default="demo")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--kv-budget", default="1GiB")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    args = parser.parse_args(argv)
    print(command_line())
    model = "demo"
    if args.model == "135m":
        sys.path.insert(0, str(Path(__file__).parent))
        from smollm_checkpoint import DEFAULT_DIR, build

        build(DEFAULT_DIR)
        model = str(DEFAULT_DIR)
    process, url = start_agent(model, args.kv_budget, args.dtype)
    results: dict[int, list[dict[str, float]]] = {level: [] for level in LEVELS}
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            complete(http)  # warm: the first request pays one-off costs
            for index in range(args.rounds):
                order = LEVELS if index % 2 == 0 else tuple(reversed(LEVELS))
                for level in order:
                    results[level].append(one_round(http, process.pid, level))
    finally:
        process.terminate()
        process.wait(30)
    print(environment())
    print(f"# {args.rounds} rounds on {args.model}, --dtype {args.dtype}; median (min-max)")
    mib = 2**20
    for level in LEVELS:
        rows = results[level]

        def column(key: str, scale: float = 1.0, rows: list[dict[str, float]] = rows) -> str:
            return spread([row[key] for row in rows], scale, ".3f" if scale == 1.0 else ".0f")

        ratio = statistics.median(row["woken_s"] / row["awake_s"] for row in rows)
        print(
            f"level {level}: wake {column('wake_s')} s; woken request {column('woken_s')} s "
            f"against awake {column('awake_s')} s ({ratio:.1f}x); released "
            f"{column('kv_bytes', 1 / mib)} MiB of KV, {column('weights_bytes', 1 / mib)} MiB "
            f"of weights; resident memory down {column('rss_drop', 1 / mib)} MiB"
        )
    print(load_average())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
