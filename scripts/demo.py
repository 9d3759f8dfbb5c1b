"""`make demo`: the story kvctl exists for, told by a real agent, a real Alertmanager and the CLI.

An agent runs the demo model on a small KV pool at 127.0.0.1:`KVCTL_DEMO_PORT` (default 8477),
with alert and resize timings shortened from minutes to seconds, and pushes its alerts to an
Alertmanager started here on a free port when the Debian package `prometheus-alertmanager` is
installed (`KVCTL_DEMO_ALERTMANAGER=off` skips it); without one, the agent's own alert list
stands in. Then, each step one line with the command it runs and the numbers before and after:

1. traffic rises (`kvctl load`) until the pool runs short and page allocations fail;
2. the agent's alert fires, with its likely cause and the command that fixes it;
3. that command grows the pool (`kvctl pool resize`);
4. the rest of the remediation lets the pool grow on demand (`kvctl config set resize.*`) until
   it holds the load with room to spare: for a stats window no allocation failed, no request
   was preempted, the pool did not grow and running requests held at most 90 % of it;
5. with auto-defrag off (`kvctl config set`), requests of mixed lengths fragment the free pages;
6. `kvctl defrag --now` compacts them, and auto-defrag goes back on;
7. the alert resolves once no allocation failed for a whole stats window, traffic still running,
   and the demo waits until the agent has no alert left and the pool holds the load again.

So what the story ends on (no failed allocation, no preemption, no alert) is what the status
table then shows.

Then `kvctl top` on a terminal (traffic runs until you quit it), or without one the status
table every 5 s for `KVCTL_DEMO_SECONDS` (default 45) and the load report. Everything started
here is stopped on exit, Ctrl-C included; the temporary folder (logs, Alertmanager's data) is
removed after a clean run and kept, and named, otherwise. A step that does not happen in time
ends the demo with one line naming it and what the pool showed then.

The agent runs without its prefix cache: cached prefixes are evicted only on demand, so under
traffic they fill every free page within seconds and there is no free space left to fragment.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".venv" / "bin"
T = TypeVar("T")

# The pool and the shortened timings: ratios over 12 s instead of 5 min, alerts evaluated every
# second and firing after 3 s instead of 15 s and 1 min, auto-resize after 1 s instead of 1 min,
# auto-defrag checking every 0.25 s instead of 5 s (so it still acts well within an alert's `for`).
POOL_PAGES = 128
SEGMENT_PAGES = 32
MAX_POOL_PAGES = 1024
"""Room to grow past this load's peaks (ten prompts of up to 1,500 tokens need up to ~1,000
pages at once), so auto-resize stops where the load fits, not at a cap."""
STATS_WINDOW_S = 12
ALERT_FOR_S = 3
RESIZE_WINDOW_S = 1
DEFRAG_CHECK_S = 0.25
ALERT_FAILURES_MIN = 3
FRAGMENTATION_ALERT = 0.9
"""Under this traffic fragmentation swings around the default alert level of 0.5 from one second
to the next, and past 0.8 for a second now and then while auto-defrag catches up: the production
`for` of 1 min smooths that out, the demo's 3 s does not."""
AGENT_FLAGS = (
    *("--no-prefix-cache", "--pool-pages", str(POOL_PAGES), "--segment-pages", str(SEGMENT_PAGES)),
    *("--max-pool-pages", str(MAX_POOL_PAGES), "--stats-window", f"{STATS_WINDOW_S}s"),
    *("--alert-interval", "1s", "--alert-for", f"{ALERT_FOR_S}s"),
    *("--set", f"alerts.alloc_failures_min={ALERT_FAILURES_MIN}"),
    *("--set", f"alerts.fragmentation_max={FRAGMENTATION_ALERT}"),
    *("--set", f"resize.window_s={RESIZE_WINDOW_S}"),
    *("--set", f"defrag.check_interval_s={DEFRAG_CHECK_S:g}"),
)
# Ten users sending prompts of 8 to 1500 tokens need up to about 330 pages, more than twice the
# pool's 128: auto-resize grows it (to 320 pages or more) until it holds them.
LOAD = (
    *("load", "--profile", "random-lengths", "--concurrency", "10", "--max-tokens", "128"),
    *("--seed", "1", "--duration", "3600"),
)
ALERT = "KvctlAllocationFailures"
HOLD_S = STATS_WINDOW_S
"""The pool holds the load once, for this long, no allocation failed, no request was preempted,
the capacity did not change and running requests never held more than ROOMY of it for as long as
an alert takes to fire (a peak that short raises nothing): a whole stats window,
so its allocation success reads 100 %."""
GROWN_S = 2 * HOLD_S
"""Step 4 waits for the pool to hold the load this long: this traffic peaks every 10 to 20 s, so
a pool that held one window may still be short at the next peak."""
ROOMY = 0.9
"""Where KvctlPoolNearlyFull clears: a pool whose peaks stay below it has room for the next."""
CALM = 0.1
"""Step 5 turns auto-defrag off at a moment fragmentation is at most this, then waits for it to
pass FRAGMENTED (with at least MIN_FREE_PAGES free pages outside reservations)."""
FRAGMENTED = 0.5
MIN_FREE_PAGES = 16
DEFRAG_WORTH = 0.3
"""A `defrag --now` that found less fragmentation (it moves fast) is repeated at the next peak."""
DEFRAG_TRIES = 8
STEPS = 7
POLL_S = 0.25


class DemoFailed(Exception):
    """A step did not happen, or something the demo started failed; the message is one line."""


class Stopped(Exception):
    """SIGTERM: stop like Ctrl-C."""


def percent(value: float) -> str:
    return f"{value * 100:.1f} %"


def window_success(pool: dict) -> float:
    """Allocation success over the stats window; 1.0 while nothing was allocated."""
    attempts = pool["window_alloc_attempts"]
    return 1.0 - pool["window_alloc_failures"] / attempts if attempts else 1.0


def summary(pool: dict | None) -> str:
    """The pool in one phrase, for a failure message."""
    if pool is None:
        return "the agent's pool could not be read"
    return (
        f"pool: {pool['capacity_pages']} pages, {pool['requests_running']} running, "
        f"{pool['requests_waiting']} waiting, alloc success {percent(window_success(pool))} "
        f"over {STATS_WINDOW_S} s, fragmentation {pool['fragmentation_ratio']:.2f}"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_line(path: Path) -> str:
    try:
        return (path.read_text(errors="replace").strip().splitlines() or [""])[-1]
    except OSError:
        return ""


class Watch(threading.Thread):
    """Reads the agent's pool every POLL_S and remembers when allocations failed, when requests
    were preempted and when the capacity last changed, so steps wait on what happened rather
    than on fixed sleeps."""

    def __init__(self, url: str) -> None:
        super().__init__(name="kvctl-demo-watch", daemon=True)
        self.url = url
        self.pool: dict | None = None
        self.first_failure_at: float | None = None
        self.last_trouble_at: float | None = None
        self.capacity_changed_at = self.crowded_at = time.monotonic()
        self.crowded_since: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=2.0) as http:
            while not self._stop.is_set():
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    self._note(http.get("/v1/pool").raise_for_status().json())
                self._stop.wait(POLL_S)

    def _note(self, pool: dict) -> None:
        now = time.monotonic()
        with self._lock:
            old = self.pool
            if old is not None and pool["alloc_failures_total"] > old["alloc_failures_total"]:
                self.last_trouble_at = now
                self.first_failure_at = self.first_failure_at or now
            if old is not None and pool["preemptions_total"] > old["preemptions_total"]:
                self.last_trouble_at = now
            if old is not None and pool["capacity_pages"] != old["capacity_pages"]:
                self.capacity_changed_at = now
            if pool["pressure_ratio"] <= ROOMY:
                self.crowded_since = None
            elif self.crowded_since is None:
                self.crowded_since = now
            elif now - self.crowded_since >= ALERT_FOR_S:  # long enough to raise an alert
                self.crowded_at = now
            self.pool = pool

    def latest(self) -> dict | None:
        with self._lock:
            return self.pool

    def quiet_for(self) -> float:
        """Seconds since an allocation last failed or a request was last preempted (infinite
        if none was)."""
        with self._lock:
            since = self.last_trouble_at
        return time.monotonic() - since if since is not None else float("inf")

    def holds_for(self) -> float:
        """Seconds the pool has held the load with room to spare: no failed allocation, no
        preemption, no resize (auto-resize grows it while it is short) and no stretch above ROOMY
        long enough to raise an alert."""
        with self._lock:
            last = max(self.capacity_changed_at, self.crowded_at)
        return min(self.quiet_for(), time.monotonic() - last)

    def stop(self) -> None:
        self._stop.set()


@dataclass
class AlertSource:
    """Where the demo watches the alert: Alertmanager's API v2, or the agent's own list."""

    where: str
    list_args: tuple[str, ...]  # `kvctl alerts list ...` that shows it
    url: str
    alertmanager: bool

    def firing(self, name: str) -> list[dict]:
        """The active alerts named `name`, as the source holds them."""
        try:
            if self.alertmanager:
                params = {"filter": f'alertname="{name}"', "active": "true"}
                answer = httpx.get(f"{self.url}/api/v2/alerts", params=params, timeout=2.0)
                return answer.raise_for_status().json()
            answer = httpx.get(f"{self.url}/v1/alerts", timeout=2.0).raise_for_status().json()
        except (httpx.HTTPError, ValueError):
            return []
        return [a for a in answer["alerts"] if a["name"] == name and a["state"] == "firing"]

    @classmethod
    def agent(cls, url: str) -> AlertSource:
        """The agent's own alert list, when no Alertmanager runs."""
        return cls("in the agent's alert list", ("alerts", "list", "--firing"), url, False)

    @staticmethod
    def texts(listed: Any, name: str) -> dict[str, str] | None:
        """Severity, description, remediation and runbook_url of `name` in what
        `kvctl --json alerts list` printed (Alertmanager's alerts, or the agent's AlertList)."""
        keys = ("description", "remediation", "runbook_url")
        if isinstance(listed, list):
            for alert in listed:
                labels, notes = alert["labels"], alert["annotations"]
                if labels.get("alertname") == name:
                    return {"severity": labels["severity"], **{k: notes[k] for k in keys}}
            return None
        for alert in listed["alerts"]:
            if alert["name"] == name and alert["state"] == "firing":
                return {k: alert[k] for k in ("severity", *keys)}
        return None


class Demo:
    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir = workdir
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.processes: dict[str, subprocess.Popen] = {}
        self._logs: list[Any] = []
        self.env = {k: v for k, v in os.environ.items() if k != "KVCTL_TOKEN"}
        self.env["KVCTL_AGENT"] = self.url
        self.watch = Watch(self.url)
        self.step_number = 0
        self.started = time.monotonic()

    # ---- processes ----------------------------------------------------------------------

    def spawn(self, name: str, args: Sequence[str], stderr_to: str | None = None) -> None:
        """Start a background process in its own session (a terminal's Ctrl-C reaches only the
        demo, which then stops it), its output in `<name>.log` in the work folder."""
        out = (self.workdir / f"{name}.log").open("wb")
        self._logs.append(out)
        err: Any = subprocess.STDOUT
        if stderr_to is not None:
            err = (self.workdir / stderr_to).open("wb")
            self._logs.append(err)
        self.processes[name] = subprocess.Popen(
            list(args),
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )

    def stop(self, name: str, timeout: float = 20.0) -> None:
        process = self.processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt, Stopped):  # or a second Ctrl-C
            process.kill()
            process.wait(10)

    def stop_all(self) -> None:
        self.watch.stop()
        for name in ("load", "agent", "alertmanager"):  # traffic first, so the agent drains fast
            with contextlib.suppress(KeyboardInterrupt, Stopped):
                self.stop(name)
        for log in self._logs:
            log.close()

    def check_alive(self) -> None:
        """Fail with the last line a background process wrote if it exited."""
        for name, shows, log, hint in (
            ("agent", "the agent", "agent.log", " (for the demo: KVCTL_DEMO_PORT=8478 make demo)"),
            ("load", "kvctl load", "load.err", ""),
            ("alertmanager", "Alertmanager", "alertmanager.log", ""),
        ):
            process = self.processes.get(name)
            if process is not None and process.poll() is not None:
                last = last_line(self.workdir / log) or "no output"
                taken = hint if "cannot listen" in last else ""
                raise DemoFailed(f"{shows} exited with code {process.returncode}: {last}{taken}")

    # ---- the CLI ------------------------------------------------------------------------

    def kvctl(self, *args: str) -> Any:
        """Run `kvctl --json ARGS` against the demo's agent and return what it printed."""
        command = [str(BIN / "kvctl"), "--json", *args]
        try:
            done = subprocess.run(
                command, env=self.env, capture_output=True, text=True, timeout=60, check=False
            )
        except subprocess.TimeoutExpired:
            raise DemoFailed(f"`{shown(args)}` did not finish within 60 s") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise DemoFailed(f"`{shown(args)}` failed with code {done.returncode}: {last}")
        return json.loads(done.stdout)

    # ---- waiting ------------------------------------------------------------------------

    def wait_for(self, what: str, probe: Callable[[], T | None], timeout: float) -> T:
        """Poll `probe` until it returns something; fail naming `what` after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                raise DemoFailed(
                    f"step {self.step_number + 1}/{STEPS}: {what} did not happen within "
                    f"{timeout:.0f} s ({summary(self.watch.latest())})"
                )
            time.sleep(POLL_S)

    def pool(self) -> dict:
        return self.wait_for("a reading of the pool", self.watch.latest, 30)

    def agent_alerts(self) -> list[str]:
        """The agent's active alerts, pending or firing (what `kvctl top` shows)."""
        try:
            listed = httpx.get(f"{self.url}/v1/alerts", timeout=2.0).raise_for_status().json()
        except (httpx.HTTPError, ValueError):
            return ["unknown (the agent's alert list could not be read)"]
        return [f"{a['name']} ({a['state']})" for a in listed["alerts"]]

    def step(self, label: str, command: str, numbers: str, *details: str) -> None:
        self.step_number += 1
        print(f"step {self.step_number}/{STEPS}  {label}: {command}   {numbers}", flush=True)
        for detail in details:
            print(f"          {detail}", flush=True)

    # ---- start --------------------------------------------------------------------------

    def start_alertmanager(self) -> AlertSource | None:
        choice = os.environ.get("KVCTL_DEMO_ALERTMANAGER", "").strip().lower()
        binary = shutil.which("alertmanager") or shutil.which("prometheus-alertmanager")
        if choice in ("off", "no", "0", "false"):
            return None
        if binary is None:
            print(
                "kvctl demo: no Alertmanager here (Debian package prometheus-alertmanager); the "
                "agent's own alert list stands in",
                flush=True,
            )
            return None
        directory = self.workdir / "alertmanager"
        directory.mkdir()
        config = {  # JSON is YAML: one route to a receiver that notifies nobody
            "route": {
                "receiver": "demo",
                "group_by": ["alertname", "instance"],
                "group_wait": "1s",
                "group_interval": "1s",
                "repeat_interval": "1h",
            },
            "receivers": [{"name": "demo"}],
        }
        (directory / "alertmanager.yml").write_text(json.dumps(config, indent=2))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.spawn(
            "alertmanager",
            [
                binary,
                f"--config.file={directory / 'alertmanager.yml'}",
                f"--storage.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",  # a lone instance: no gossip port
                "--log.level=warn",
            ],
        )

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/-/ready", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        self.wait_for("Alertmanager answering /-/ready", ready, 30)
        print(f"kvctl demo: Alertmanager ({Path(binary).name}) on {url}", flush=True)
        return AlertSource("in Alertmanager", ("alerts", "list", "--from-am", url), url, True)

    def start_agent(self, alertmanager: AlertSource | None) -> None:
        args = [str(BIN / "kvctl-agent"), "--port", str(self.port), *AGENT_FLAGS]
        if alertmanager is not None:
            args += ["--alertmanager-url", alertmanager.url]
        print(f"kvctl demo: {shown(args[1:], 'kvctl-agent')}", flush=True)
        print(
            f"kvctl demo: seconds where production has minutes: ratios over {STATS_WINDOW_S} s, "
            f"alerts firing after {ALERT_FOR_S} s, auto-resize after {RESIZE_WINDOW_S} s, "
            f"auto-defrag checking every {DEFRAG_CHECK_S:g} s",
            flush=True,
        )
        print(
            "kvctl demo: no prefix cache (it would fill every free page, leaving nothing to "
            f"fragment); fragmentation alerts above {FRAGMENTATION_ALERT} (this traffic swings it "
            "around 0.5 from second to second)",
            flush=True,
        )
        self.spawn("agent", args)

        def healthy() -> bool:
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        self.wait_for(f"the agent answering on {self.url}", healthy, 120)
        self.watch.start()

    # ---- the story ----------------------------------------------------------------------

    def story(self, alerts: AlertSource) -> None:
        start = self.pool()
        self.traffic_rises(start)
        remediation, fired = self.alert_fires(alerts)
        resized = self.fix(remediation)
        self.grow_on_demand(remediation, resized)
        compacted = self.fragment_then_defrag()
        end = self.alert_resolves(alerts, fired)
        print(
            f"kvctl demo: done in {time.monotonic() - self.started:.0f} s: the pool holds the "
            f"load at {end['capacity_pages']} pages (from {start['capacity_pages']}): no "
            f"allocation failed and no request was preempted for {self.watch.quiet_for():.0f} s, "
            f"and no alert is pending or firing; defrag took fragmentation "
            f"{compacted['fragmentation_before']:.2f} → {compacted['fragmentation_after']:.2f}",
            flush=True,
        )

    def traffic_rises(self, before: dict) -> None:
        self.spawn("load", [str(BIN / "kvctl"), *LOAD], stderr_to="load.err")
        short = self.wait_for(
            f"at least {ALERT_FAILURES_MIN} failed page allocations",
            lambda: self._with(lambda p: p["window_alloc_failures"] >= ALERT_FAILURES_MIN),
            90,
        )
        self.step(
            "traffic rises",
            f"{shown(LOAD)} &",
            f"requests in flight {in_flight(before)} → {in_flight(short)}, "
            f"alloc success {percent(window_success(before))} → "
            f"{percent(window_success(short))} ({short['window_alloc_failures']} of "
            f"{short['window_alloc_attempts']} page allocations failed)",
        )

    def alert_fires(self, alerts: AlertSource) -> tuple[str, dict]:
        """Wait for the alert, show its cause and remediation; (remediation, pool then)."""
        self.wait_for(f"{ALERT} firing {alerts.where}", lambda: alerts.firing(ALERT), 60)
        fired = self.pool()
        first = self.watch.first_failure_at or self.started
        texts = AlertSource.texts(self.kvctl(*alerts.list_args), ALERT)
        if texts is None:
            raise DemoFailed(f"`{shown(alerts.list_args)}` does not list {ALERT} any more")
        self.step(
            "alert fires",
            shown(alerts.list_args),
            f"{ALERT} ({texts['severity']}) none → firing {alerts.where}, "
            f"{time.monotonic() - first:.0f} s after the first failed allocation",
            f"why: {texts['description']}",
            f"fix: {texts['remediation']}",
            f"runbook: {texts['runbook_url']}",
        )
        return texts["remediation"], fired

    def fix(self, remediation: str) -> dict:
        """Run the resize the alert names; the ResizeResult."""
        found = re.search(r"`kvctl (?:--agent \S+ )?pool resize (--pages \d+)`", remediation)
        if found is None:
            raise DemoFailed(f"the alert names no `kvctl pool resize` command: {remediation}")
        args = ("pool", "resize", *found.group(1).split(), "--yes")
        result = self.kvctl(*args)
        self.step(
            "fix", shown(args), f"capacity {result['old_pages']} → {result['new_pages']} pages"
        )
        return result

    def grow_on_demand(self, remediation: str, resized: dict) -> None:
        """Set what the alert suggests for automatic growth, until the pool holds the load."""
        wanted = re.findall(r"`(resize\.[a-z_]+=[^`]+)`", remediation) or ["resize.enabled=true"]
        args = ("config", "set", *wanted)
        self.kvctl(*args)
        settled = self.wait_for(
            f"the pool growing past {resized['new_pages']} pages, then holding the load (no "
            f"failed allocation, no preemption, no resize, never above {percent(ROOMY)} for "
            f"{ALERT_FOR_S} s) for "
            f"{GROWN_S:.0f} s",
            lambda: self._with(
                lambda p: (
                    p["capacity_pages"] > resized["new_pages"] and self.watch.holds_for() >= GROWN_S
                )
            ),
            150,
        )
        self.step(
            "grow on demand",
            shown(args),
            f"capacity {resized['new_pages']} → {settled['capacity_pages']} pages, no allocation "
            f"failed and no request preempted for {self.watch.quiet_for():.0f} s, running "
            f"requests never above {percent(ROOMY)} of it for {ALERT_FOR_S} s",
        )

    def fragment_then_defrag(self) -> dict:
        """Auto-defrag off at a calm moment, `defrag --now` at a peak, auto-defrag back on;
        the DefragResult."""
        calm = self.wait_for(
            f"a moment with fragmentation at or below {CALM}",
            lambda: self._with(lambda p: p["fragmentation_ratio"] <= CALM),
            60,
        )
        off = ("config", "set", "defrag.enabled=false")
        self.kvctl(*off)
        compacted = self._defrag_at_a_peak()
        self.step(
            "fragmentation builds",
            shown(off),
            f"fragmentation {calm['fragmentation_ratio']:.2f} → "
            f"{compacted['fragmentation_before']:.2f}, free pages in {calm['free_extents']} → "
            f"{compacted['free_extents_before']} extents",
        )
        on = ("config", "set", "defrag.enabled=true")
        self.kvctl(*on)
        self.step(
            "defrag",
            shown(("defrag", "--now")),
            f"fragmentation {compacted['fragmentation_before']:.2f} → "
            f"{compacted['fragmentation_after']:.2f}, free extents "
            f"{compacted['free_extents_before']} → {compacted['free_extents_after']}, "
            f"{compacted['pages_moved']} pages moved in {compacted['seconds'] * 1000:.1f} ms; "
            f"auto-defrag back on: {shown(on)}",
        )
        return compacted

    def alert_resolves(self, alerts: AlertSource, fired: dict) -> dict:
        # resolved, and a whole window without a failed allocation to show for it (the alert's
        # evaluation lags the pool's reading: a failure in between would show 99.9 %)
        def resolved_and_clean() -> dict | None:
            reading = self.pool()
            return reading if window_success(reading) == 1.0 and not alerts.firing(ALERT) else None

        self.wait_for(f"{ALERT} resolving {alerts.where}", resolved_and_clean, STATS_WINDOW_S + 90)
        # then every alert, and the pool holding the load: what the status table goes on to show
        held = self.wait_for(
            f"the pool holding the load for {HOLD_S:.0f} s with no alert left at the agent",
            lambda: self._with(
                lambda p: (
                    self.watch.holds_for() >= HOLD_S
                    and window_success(p) == 1.0
                    and not self.agent_alerts()
                )
            ),
            90,
        )
        self.step(
            "alert resolves",
            shown(alerts.list_args),
            f"{ALERT} firing → resolved {alerts.where}, alloc success "
            f"{percent(window_success(fired))} → {percent(window_success(held))} over the "
            f"last {STATS_WINDOW_S} s, no alert left at the agent, requests in flight "
            f"{in_flight(held)}",
        )
        return held

    def _with(self, holds: Callable[[dict], bool]) -> dict | None:
        """The latest pool reading if `holds(pool)`, else None."""
        pool = self.watch.latest()
        return pool if pool is not None and holds(pool) else None

    def _defrag_at_a_peak(self) -> dict:
        """Wait until the free pages are fragmented, then `kvctl defrag --now`. Fragmentation
        under traffic comes and goes within a second, so a run that found the pool already
        compacted by finishing requests is repeated at the next peak."""
        for _ in range(DEFRAG_TRIES):
            self.wait_for(
                f"fragmentation above {FRAGMENTED}",
                lambda: self._with(
                    lambda p: (
                        p["fragmentation_ratio"] > FRAGMENTED
                        and p["free_pages"] - p["reserved_pages"] >= MIN_FREE_PAGES
                    )
                ),
                60,
            )
            result = self.kvctl("defrag", "--now")
            if result["fragmentation_before"] >= DEFRAG_WORTH and result["pages_moved"] > 0:
                return result
        raise DemoFailed(
            f"step {self.step_number + 1}/{STEPS}: `kvctl defrag --now` found fragmentation "
            f"below {DEFRAG_WORTH} {DEFRAG_TRIES} times ({summary(self.watch.latest())})"
        )

    # ---- the dashboard ------------------------------------------------------------------

    def dashboard(self, seconds: float) -> None:
        kvctl = str(BIN / "kvctl")
        if sys.stdin.isatty() and sys.stdout.isatty():
            print("kvctl demo: kvctl top (traffic keeps running; q quits)", flush=True)
            subprocess.run([kvctl, "top", "--interval", "1"], env=self.env, check=False)
            return
        top = ("top", "--headless", "--duration", f"{seconds:g}", "--every", "5")
        print(f"kvctl demo: {shown(top)} (no terminal), then the load report", flush=True)
        shown_top = subprocess.run([kvctl, *top], env=self.env, check=False)
        if shown_top.returncode != 0:
            raise DemoFailed(f"`{shown(top)}` exited with code {shown_top.returncode}")
        self.stop("load")
        print(flush=True)
        print((self.workdir / "load.log").read_text(errors="replace"), end="", flush=True)


def in_flight(pool: dict) -> int:
    return pool["requests_running"] + pool["requests_waiting"]


def shown(args: Sequence[str], program: str = "kvctl") -> str:
    """A command as a user would type it against the demo's agent (KVCTL_AGENT names it)."""
    return shlex.join([program, *args])


def on_sigterm(signum: int, frame: object) -> None:
    raise Stopped


def main() -> int:
    port = int(os.environ.get("KVCTL_DEMO_PORT") or 8477)
    seconds = float(os.environ.get("KVCTL_DEMO_SECONDS") or 45)
    workdir = Path(tempfile.mkdtemp(prefix="kvctl-demo."))
    signal.signal(signal.SIGTERM, on_sigterm)
    demo = Demo(workdir, port)
    status = 1
    try:
        alertmanager = demo.start_alertmanager()
        demo.start_agent(alertmanager)
        demo.story(alertmanager or AlertSource.agent(demo.url))
        demo.dashboard(seconds)
        status = 0
    except DemoFailed as error:
        print(f"kvctl demo: {error}", file=sys.stderr, flush=True)
    except (KeyboardInterrupt, Stopped) as stop:
        status = 128 + (signal.SIGTERM if isinstance(stop, Stopped) else signal.SIGINT)
        print("\nkvctl demo: interrupted; stopping what it started", file=sys.stderr, flush=True)
    finally:
        demo.stop_all()
        if status == 0:
            shutil.rmtree(workdir, ignore_errors=True)  # a clean run leaves nothing behind
        else:
            print(f"kvctl demo: logs kept in {workdir}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
