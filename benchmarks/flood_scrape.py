"""Monitoring under a flood: latency of `/healthz`, `/metrics` and `/v1/pool` while 1,000
requests wait, against the same scrapes of the same agent when idle.

Monitoring must keep answering exactly when the node is overloaded: Prometheus gives up a scrape
after 10 s by default, and an agent that does not answer reads as down. Those three routes are
served from the snapshot the engine publishes, never waiting on the engine, so their latency
should not depend on the queue.

One real agent (demo model, default pool, `--max-waiting` raised so that the whole flood is
queued) runs in its own process; a second process holds 1,000 plain completions open against
it; this process scrapes round-robin at `--rate` per second. Rounds alternate idle and flooded
(paired, interleaved), each flooded round starting a fresh flood; the idle rounds are the
baseline. The queue range printed is the agent's own count of waiting requests during the
flooded scrapes.

`--defaults` runs the agent with its default settings instead (at most 256 queued, the rest
answered 429) and starts scraping the moment the flood starts, so the scrapes meet the burst
of arrivals itself: 1,000 connections opened, read, parsed and answered at once.

    python benchmarks/flood_scrape.py [--requests 1000] [--rounds 3] [--scrapes 150] [--rate 20]
        [--defaults]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from agent_process import launch_agent

ROUTES = ("/healthz", "/metrics", "/v1/pool")
FLOOD = """
import asyncio, sys, httpx
async def main(url, count):
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        body = {"prompt": "flood the queue", "max_tokens": 256, "ignore_eos": True}
        await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(count)),
                             return_exceptions=True)
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def scrape_round(http: httpx.Client, scrapes: int, rate: float) -> tuple[dict, list[int]]:
    """`scrapes` GETs round-robin over ROUTES at `rate` per second: latencies per route (s)
    and the queue length the agent reported in its `/v1/pool` answers."""
    latencies: dict[str, list[float]] = {route: [] for route in ROUTES}
    waiting: list[int] = []
    due = time.monotonic()
    for i in range(scrapes):
        route = ROUTES[i % len(ROUTES)]
        due += 1.0 / rate
        started = time.perf_counter()
        response = http.get(route)
        latencies[route].append(time.perf_counter() - started)
        response.raise_for_status()
        if route == "/v1/pool":
            waiting.append(response.json()["requests_waiting"])
        time.sleep(max(0.0, due - time.monotonic()))
    return latencies, waiting


def wait_until_queued(http: httpx.Client, count: int, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        waiting = http.get("/v1/pool").json()["requests_waiting"]
        if waiting >= 0.9 * count:
            return waiting
        time.sleep(0.2)
    raise SystemExit(f"the flood never queued {count} requests (saw {waiting})")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scrapes", type=int, default=150)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--defaults", action="store_true")
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="the agent's (default: its own default)"
    )
    args = parser.parse_args()
    flags = ("--torch-threads", str(args.torch_threads)) if args.torch_threads else ()
    agent = (
        launch_agent(*flags)
        if args.defaults
        else launch_agent("--max-waiting", str(args.requests + 64), *flags)
    )
    idle: dict[str, list[float]] = {route: [] for route in ROUTES}
    print(f"agent torch threads: {args.torch_threads or 'its default (every core)'}")
    flooded: dict[str, list[float]] = {route: [] for route in ROUTES}
    queue: list[int] = []
    try:
        with httpx.Client(base_url=agent.url, timeout=60) as http:
            for _ in range(args.rounds):
                latencies, _ = scrape_round(http, args.scrapes, args.rate)
                for route in ROUTES:
                    idle[route] += latencies[route]
                flood = subprocess.Popen(
                    [sys.executable, "-c", FLOOD, agent.url, str(args.requests)]
                )
                try:
                    if not args.defaults:
                        wait_until_queued(http, args.requests)
                    latencies, waiting = scrape_round(http, args.scrapes, args.rate)
                finally:
                    flood.kill()
                    flood.wait()
                for route in ROUTES:
                    flooded[route] += latencies[route]
                queue += waiting
                while http.get("/v1/pool").json()["requests_waiting"]:  # aborted as clients go
                    time.sleep(0.2)
    finally:
        agent.stop()

    print(
        f"{'default settings, scraping from the first arrival' if args.defaults else ''}\n"
        f"{args.rounds} paired rounds of {args.scrapes} scrapes at {args.rate:g}/s; "
        f"flooded: {args.requests} requests in flight, agent queue {min(queue)}-{max(queue)} "
        f"waiting (median {statistics.median(queue):.0f})"
    )
    print(
        f"{'route':<10} {'idle p50':>9} {'idle p99':>9} {'flood p50':>10} {'flood p99':>10} "
        f"{'flood max':>10} {'p99 ratio':>10}"
    )
    for route in ROUTES:
        a, b = idle[route], flooded[route]
        print(
            f"{route:<10} {percentile(a, 50) * 1e3:8.1f}ms {percentile(a, 99) * 1e3:8.1f}ms "
            f"{percentile(b, 50) * 1e3:9.1f}ms {percentile(b, 99) * 1e3:9.1f}ms "
            f"{max(b) * 1e3:9.1f}ms {percentile(b, 99) / percentile(a, 99):9.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
