"""`kvctl status --prometheus`: the fleet table of 500 nodes from a real Prometheus, against
asking each node (`kvctl status -a ...`).

A fleet's nodes are already scraped; reading the table from Prometheus is about a dozen
instant queries whatever the fleet's size, where `-a` makes three calls per kvctl agent and one
per engine. Here a real Prometheus (`prometheus` on PATH) scrapes 500 targets every 5 s, all
answered by one fixture server (tests/exposition_server.py, in its own process): 40 % kvctl
agents, 40 % vLLM, 10 % SGLang, 10 % TensorRT-LLM, node n's recorded exposition with its values
varied by n, each target with its own `instance` (`node-017:8000`) in a job per kind, plus
`--down` targets on a closed port (down rows). Once every target has been scraped at least
three times (rate() needs two samples), each round times, as a user runs them (a subprocess,
end to end, the interpreter's start included):

- `kvctl status --prometheus URL`, the table (at 200 columns) and `--json`;
- `kvctl status -a URL ...` of the fleet's 200 kvctl agents (their JSON API) and of its
  200 vLLM nodes (`vllm+http://...`, their /metrics), straight from the fixture server;
- in this process, `PrometheusFleet.read()` alone (queries and building the readings).

The sides run in a rotated order each round. Every run is checked: a row per target, and
figures that are not all "–". Times are the median (min-max) over the rounds; the ratios
are per round, `-a` over the table from Prometheus; beside them, the CPU seconds the fixture
server and Prometheus spent during each run (on the same cores as kvctl). Then where the time
goes: the interpreter's start, each query alone, building the readings (also over the answers
repeated 4 and 10 times, a larger fleet), rendering; and for `-a`, creating its clients, and
its read with one SSL context forced on every client (httpx patched here): kvctl's clients
share one already (`kvctl.client.tls_context`), so the two should not differ.

The machine is shared: run it alone (`flock /tmp/kvctl-bench.lock python ...`).

    python benchmarks/fleet_prometheus.py [--nodes 500] [--down 5] [--rounds 7] [--each 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import yaml
from paired import MIN_ROUNDS, command_line, environment, load_average, spread

import kvctl
from kvctl.prometheus_fleet import PrometheusFleet, build_readings

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "tests" / "exposition_server.py"
SHARES = (("kvctl", 4), ("vllm", 4), ("sglang", 1), ("trtllm", 1))
PATTERN = tuple(kind for kind, share in SHARES for _ in range(share))
INTERVAL = 5
WIDTH = 200
TARGET_SECONDS = 2.0
METRICS_PATHS = {"trtllm": "/prometheus/metrics"}


def kind_of(node: int) -> str:
    return PATTERN[node % len(PATTERN)]


def instance(node: int) -> str:
    return f"node-{node:03d}:8000"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_config(server: str, nodes: int, down: int, closed: str) -> dict:
    """A job per kind; a static target per node, all at the fixture server, told apart by
    their `instance` and `__metrics_path__`; `down` more on a closed port."""
    groups: dict[str, list[dict]] = {kind: [] for kind, _ in SHARES}
    for node in range(nodes + down):
        kind = kind_of(node)
        path = f"/node/{node}/{kind}{METRICS_PATHS.get(kind, '/metrics')}"
        labels = {"instance": instance(node), "__metrics_path__": path}
        groups[kind].append({"targets": [server if node < nodes else closed], "labels": labels})
    jobs = [{"job_name": kind, "static_configs": targets} for kind, targets in groups.items()]
    timing = {"scrape_interval": f"{INTERVAL}s", "scrape_timeout": f"{INTERVAL}s"}
    return {"global": {**timing, "evaluation_interval": f"{INTERVAL}s"}, "scrape_configs": jobs}


@contextlib.contextmanager
def running(args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout:.0f} s")


def query(prometheus: str, promql: str) -> list[dict]:
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=30)
    answer.raise_for_status()
    return answer.json()["data"]["result"]


def wait_scraped(prometheus: str, targets: int, scrapes: int = 3, timeout: float = 180) -> float:
    """Seconds until every target has been scraped `scrapes` times."""
    started = time.monotonic()
    promql = f"count(count_over_time(up[10m]) >= {scrapes})"
    while time.monotonic() - started < timeout:
        result = query(prometheus, promql)
        if result and int(float(result[0]["value"][1])) >= targets:
            return time.monotonic() - started
        time.sleep(1)
    raise SystemExit(f"not every one of {targets} targets was scraped {scrapes} times")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kvctl_command(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("kvctl")), "status", *args]


def run_timed(command: list[str]) -> tuple[float, str]:
    """Wall seconds of `command` and its stdout; it exits 3 (some node is down) or 0."""
    env = {**os.environ, "COLUMNS": str(WIDTH), "NO_COLOR": "1"}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    seconds = time.perf_counter() - started
    if done.returncode not in (0, 3):
        raise SystemExit(f"{command[:4]} ... exited {done.returncode}: {done.stderr[-2000:]}")
    return seconds, done.stdout


def check_json(stdout: str, rows: int, down: int) -> None:
    """A row per target, `down` of them down, and figures in the others."""
    agents = json.loads(stdout)["agents"]
    up = [a for a in agents if a["up"]]
    figured = [a for a in up if any(v is not None for v in (a["figures"] or {}).values())]
    if len(agents) != rows or len(agents) - len(up) != down or len(figured) != len(up):
        raise SystemExit(
            f"--json: {len(agents)} rows ({rows} expected), {len(agents) - len(up)} down "
            f"({down} expected), {len(figured)} of {len(up)} up rows with figures"
        )


def check_table(stdout: str, rows: int, down: int) -> None:
    """A line per target, `down` of them DOWN, and figures ("%") in every other."""
    lines = [line for line in stdout.splitlines() if "://" in line]
    downs = [line for line in lines if " DOWN " in line]
    figured = [line for line in lines if " up " in line and "%" in line]
    if len(lines) != rows or len(downs) != down or len(figured) != rows - down:
        raise SystemExit(
            f"table: {len(lines)} rows ({rows} expected), {len(downs)} down ({down} expected), "
            f"{len(figured)} with figures"
        )


def read_in_process(prometheus: str) -> tuple[float, int]:
    """Wall seconds of `PrometheusFleet.read()` (the client's start included) and rows."""

    async def read() -> int:
        fleet = PrometheusFleet(prometheus)
        try:
            return len(await fleet.read())
        finally:
            await fleet.aclose()

    started = time.perf_counter()
    rows = asyncio.run(read())
    return time.perf_counter() - started, rows


def profile(prometheus: str, rows: int) -> None:
    """Where one `kvctl status --prometheus` goes: the interpreter and imports, each query
    alone, decoding, building the readings, rendering the table and the JSON."""
    from rich.console import Console

    from kvctl.fleet import json_entries
    from kvctl.prometheus_fleet import _series
    from kvctl.view import render

    kvctl_binary = str(Path(sys.executable).with_name("kvctl"))
    imports = "import kvctl.cli.main, kvctl.cli.status, kvctl.prometheus_fleet, kvctl.view.render"
    for label, command in (
        ("interpreter + `kvctl --version`", [kvctl_binary, "--version"]),
        ("interpreter + the imports of a status run", [sys.executable, "-c", imports]),
    ):
        times = []
        for _ in range(5):
            started = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            times.append(time.perf_counter() - started)
        print(f"  {label}: {statistics.median(times) * 1e3:.0f} ms (median of 5)")
    fleet = PrometheusFleet(prometheus)
    answers: dict[str, list] = {}
    print(f"  {'query':<14}{'ms (5 runs: median)':>20}{'series':>8}{'KiB':>8}{'decode ms':>11}")
    with httpx.Client(base_url=prometheus, timeout=30) as http:
        for key, promql in fleet.queries().items():
            times, size, decode = [], 0, []
            for _ in range(5):
                t0 = time.perf_counter()
                response = http.get("/api/v1/query", params={"query": promql})
                times.append(time.perf_counter() - t0)
                size = len(response.content)
                t0 = time.perf_counter()
                answers[key] = [_series(i) for i in response.json()["data"]["result"]]
                decode.append(time.perf_counter() - t0)
            print(
                f"  {key:<14}{statistics.median(times) * 1e3:>20.1f}{len(answers[key]):>8}"
                f"{size / 1024:>8.0f}{statistics.median(decode) * 1e3:>11.2f}"
            )
    timings: dict[str, Callable[[], object]] = {}
    readings = build_readings(answers)
    timings["build_readings"] = lambda: build_readings(answers)
    timings["render table"] = lambda: Console(
        file=io.StringIO(), width=WIDTH, soft_wrap=False, highlight=False
    ).print(render.status(readings))
    timings["json entries + dumps"] = lambda: json.dumps(
        {"agents": json_entries(readings)}, indent=2
    )
    for name, fn in timings.items():
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(f"  {name:<22}{statistics.median(times) * 1e3:>8.1f} ms (median of 5)")
    asyncio.run(fleet.aclose())
    assert len(readings) == rows
    for factor in (4, 10):
        seconds = scaled_build(answers, factor)
        print(f"  build_readings, {rows * factor:,} rows (answers x {factor}): {seconds:.3f} s")


def scaled_build(answers: dict[str, list], factor: int) -> float:
    """Seconds of `build_readings` over the answers repeated `factor` times under new
    instance names: a fleet `factor` times as large."""
    from kvctl.prometheus_fleet import Series

    bigger = {
        key: [
            Series({**s.labels, "instance": f"{s.labels.get('instance', '')}-{copy}"}, s.value)
            for copy in range(factor)
            for s in series
        ]
        for key, series in answers.items()
    }
    started = time.perf_counter()
    build_readings(bigger)
    return time.perf_counter() - started


def profile_agents(urls: list[str]) -> None:
    """`read_fleet_once` of kvctl agents: as it is, and with every client sharing one SSL
    context (httpx builds one per client, loading the CA bundle, even for http://)."""
    import httpx._transports.default as transport

    from kvctl.client import AsyncAgentClient
    from kvctl.fleet import read_fleet_once

    started = time.perf_counter()
    clients = [AsyncAgentClient(url) for url in urls]
    made = time.perf_counter() - started
    for client in clients:
        asyncio.run(client.aclose())
    print(f"  {len(urls)} x AsyncAgentClient(): {made:.2f} s")
    original = transport.create_ssl_context
    shared = original()
    for label, make in (("as it is", original), ("one SSL context shared", lambda **_: shared)):
        transport.create_ssl_context = make
        try:
            times = []
            for _ in range(3):
                started = time.perf_counter()
                readings = read_fleet_once(urls)
                times.append(time.perf_counter() - started)
        finally:
            transport.create_ssl_context = original
        assert all(reading.up for reading in readings)
        print(f"  read_fleet_once, {label}: {spread(times)} s (median (min-max) of 3)")


def sides_of(
    prometheus: str, server: str, rows: int, down: int, agents: list[int], engines: list[int]
) -> dict[str, tuple[list[str], int, Callable[[str], None]]]:
    """Each side's command, its rows, and the check of its output."""
    agent_args = [a for n in agents for a in ("-a", f"{server}/node/{n}/kvctl")]
    engine_args = [a for n in engines for a in ("-a", f"vllm+{server}/node/{n}/vllm")]
    return {
        "prometheus, table": (
            kvctl_command("--prometheus", prometheus),
            rows,
            lambda out: check_table(out, rows, down),
        ),
        "prometheus, --json": (
            kvctl_command("--prometheus", prometheus, "--json"),
            rows,
            lambda out: check_json(out, rows, down),
        ),
        f"-a x {len(agents)} kvctl agents": (
            kvctl_command(*agent_args),
            len(agents),
            lambda out: check_table(out, len(agents), 0),
        ),
        f"-a x {len(engines)} vLLM": (
            kvctl_command(*engine_args),
            len(engines),
            lambda out: check_table(out, len(engines), 0),
        ),
    }


def measure(prometheus: str, sides: dict, pids: tuple[int, int], rounds: int) -> dict:
    """Wall seconds of each side per round (in a rotated order), the fixture server's and
    Prometheus' CPU seconds during each run, and `PrometheusFleet.read()` in this process."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    in_process: list[float] = []
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            command, _, check = sides[name]
            before = [cpu_seconds(pid) for pid in pids]
            seconds, stdout = run_timed(command)
            after = [cpu_seconds(pid) for pid in pids]
            check(stdout)
            times[name].append(seconds)
            cpu[name].append((after[0] - before[0], after[1] - before[1]))
        seconds, read_rows = read_in_process(prometheus)
        expected = sides["prometheus, table"][1]
        if read_rows != expected:
            raise SystemExit(f"PrometheusFleet.read(): {read_rows} readings of {expected}")
        in_process.append(seconds)
    return {"times": times, "cpu": cpu, "read": in_process}


def report(sides: dict, measured: dict, rounds: int) -> bool:
    """The table of both sides and their ratios; whether the target was met."""
    times, cpu = measured["times"], measured["cpu"]
    base = times["prometheus, table"]
    print(
        f"\nwall seconds, median (min-max) over {rounds} rounds; ratio: per round, over the "
        "table from Prometheus; server, prom: CPU seconds the fixture server and Prometheus "
        "spent during the run (median; their scrapes included)"
    )
    print(
        f"{'side':<26}{'rows':>5}{'seconds':>20}{'ratio':>20}{'ms/row':>8}{'server':>8}{'prom':>6}"
    )
    for name, (_, rows, _) in sides.items():
        ratio = [a / b for a, b in zip(times[name], base, strict=True)]
        per_row = statistics.median(times[name]) / rows * 1e3
        server = statistics.median(c[0] for c in cpu[name])
        prom = statistics.median(c[1] for c in cpu[name])
        print(
            f"{name:<26}{rows:>5}{spread(times[name]):>20}{spread(ratio) + 'x':>20}"
            f"{per_row:>8.2f}{server:>8.2f}{prom:>6.2f}"
        )
    rows = sides["prometheus, table"][1]
    print(f"{'PrometheusFleet.read()':<26}{rows:>5}{spread(measured['read'], fmt='.3f'):>20}")
    met = statistics.median(base) < TARGET_SECONDS
    print(
        f"target: the table of {rows} rows from Prometheus in under {TARGET_SECONDS:g} s: "
        f"{'met' if met else 'NOT met'}"
    )
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=500, help="targets that answer")
    parser.add_argument("--down", type=int, default=5, help="targets on a closed port")
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f"at least {MIN_ROUNDS}")
    parser.add_argument("--each", type=int, default=200, help="nodes of each -a side")
    args = parser.parse_args()
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: fewer say little")
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus is not installed: apt-get install prometheus")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True)
    print(command_line())
    print(environment())
    print(
        f"# {(version.stdout or version.stderr).splitlines()[0]}; kvctl {kvctl.__version__}; "
        f"nproc {os.cpu_count()}"
    )
    rows = args.nodes + args.down
    agents = [n for n in range(args.nodes) if kind_of(n) == "kvctl"][: args.each]
    engines = [n for n in range(args.nodes) if kind_of(n) == "vllm"][: args.each]
    with tempfile.TemporaryDirectory(prefix="kvctl-fleet-") as work:
        work_dir = Path(work)
        port, prom_port = free_port(), free_port()
        server = f"http://127.0.0.1:{port}"
        prometheus = f"http://127.0.0.1:{prom_port}"
        closed = f"127.0.0.1:{free_port()}"
        config = prometheus_config(f"127.0.0.1:{port}", args.nodes, args.down, closed)
        (work_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        served = [sys.executable, str(SERVER), "--port", str(port)]
        prom_args = [
            binary,
            f"--config.file={work_dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={work_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ]
        with (
            running(served, work_dir / "server.log") as server_process,
            running(prom_args, work_dir / "prometheus.log") as prom_process,
        ):
            wait_for(f"{server}/node/0/kvctl/healthz")
            wait_for(f"{prometheus}/-/ready")
            waited = wait_scraped(prometheus, rows)
            print(
                f"# every one of {rows} targets ({args.down} on a closed port) scraped 3 times "
                f"after {waited:.0f} s (scrape_interval {INTERVAL} s)"
            )
            pids = (server_process.pid, prom_process.pid)
            before = [cpu_seconds(pid) for pid in pids]
            time.sleep(2 * INTERVAL)  # nothing but the scrapes: the background's own cost
            spent = [cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)]
            idle = [seconds / (2 * INTERVAL) for seconds in spent]
            print(
                f"# scrapes alone cost: the fixture server {idle[0]:.1%} of a core, "
                f"Prometheus {idle[1]:.1%}"
            )
            sides = sides_of(prometheus, server, rows, args.down, agents, engines)
            met = report(sides, measure(prometheus, sides, pids, args.rounds), args.rounds)
            print("\nprofile of the Prometheus path (one run, sequential queries):")
            profile(prometheus, rows)
            print("\nprofile of -a, in this process:")
            profile_agents([f"{server}/node/{n}/kvctl" for n in agents])
    print(load_average())
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
