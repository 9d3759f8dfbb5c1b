"""Decode-step time of the engine alone vs inside the running agent (HTTP, metrics, snapshots).

Same model, same pool, same eight greedy requests. Alone: a loop calls `Engine.step()`. In the
agent: the requests arrive over HTTP, the engine runs on the main thread as in `kvctl-agent`
(HTTP on another thread), the service
publishes a `PoolSnapshot` after every step, and a scraper reads `/metrics` and `/v1/pool` every
`--scrape-interval` seconds (far more often than Prometheus would) while the alert loop
evaluates every second. The clients run in a
separate process, as they do in production. Both sides time the
period from one `Engine.step()` to the next while requests decode, which includes whatever the
agent does between steps. Rounds are paired and interleaved (agent, alone, alone, agent, ...);
each round keeps each side's median ms/step, and the overhead is the median (min-max) of the
per-round ratios agent / alone, minus one.

    python benchmarks/agent_overhead.py [--prompt-tokens 256] [--max-tokens 64] [--rounds 8]
        [--torch-threads N]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import threading
import time

import httpx
import torch
import uvicorn
from paired import MIN_ROUNDS, command_line, environment, load_average, paired_rounds, spread

from kvctl.agent.config import AgentConfig
from kvctl.agent.http.server import create_app
from kvctl.agent.model import SamplingParams, build_demo_model
from kvctl.agent.model_pool import ModelPool
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.agent.service import AgentService
from kvctl.agent.startup.wiring import alert_loop, default_torch_threads
from kvctl.settings import StartupLimits

BATCH = 8


def timed_steps(engine: Engine) -> list[float]:
    """Wrap `engine.step` so that the time from one step's start to the next is recorded: the
    step itself plus whatever runs between steps (snapshots, commands, other threads)."""
    times: list[float] = []
    step = engine.step
    last = [0.0]

    def timed() -> list:
        start = time.perf_counter()
        if last[0] and engine.scheduler.running:
            times.append(start - last[0])
        last[0] = start
        return step()

    engine.step = timed  # type: ignore[method-assign]  # the step timed in place
    return times


def make_engine(model, tokenizer) -> Engine:
    config = EngineConfig(pool_pages=1024, segment_pages=128, prefix_cache=False)
    return Engine(model, tokenizer, config)


def prompts(args: argparse.Namespace) -> list[list[int]]:
    return [
        [256] + [65 + (i + j) % 26 for j in range(args.prompt_tokens - 1)] for i in range(BATCH)
    ]


def alone(model, tokenizer, args: argparse.Namespace) -> list[float]:
    engine = make_engine(model, tokenizer)
    times = timed_steps(engine)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for prompt in prompts(args):
        engine.add_request(prompt, params)
    while engine.has_work():
        engine.step()
    return times[1:-1]  # neither the prefill nor the last step


def in_agent(model, tokenizer, args: argparse.Namespace) -> list[float]:
    engine = make_engine(model, tokenizer)
    times = timed_steps(engine)
    limits = StartupLimits(engine.pool.segment_pages, engine.pool.capacity)
    service = AgentService([ModelPool(engine, "demo", limits)])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    # the alert loop too, evaluating every second (15 s by default)
    service.settings = service.settings.model_copy(
        update={"alerts": service.settings.alerts.model_copy(update={"interval_s": 1.0})}
    )
    service.alerting = alert_loop(service, AgentConfig(), url)
    app = create_app(service, AgentConfig(), run_engine=False)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # not the main thread
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    body = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    bodies = [{**body, "prompt": p} for p in prompts(args)]
    # clients live in another process, as they do in production: they must not share the GIL
    clients = multiprocessing.get_context("spawn").Process(
        target=run_clients, args=(url, bodies, args.scrape_interval)
    )
    clients.start()
    # as in kvctl-agent: the engine on the main thread, HTTP on another
    service.run(lambda: not clients.is_alive(), grace=0)
    server.should_exit = True
    return times[1:-1]


def run_clients(url: str, bodies: list[dict], scrape_interval: float) -> None:
    """The load: one thread per request, and a scraper of /metrics and /v1/pool."""
    stop = threading.Event()
    scraper = threading.Thread(target=scrape, args=(url, scrape_interval, stop), daemon=True)
    scraper.start()
    workers = [threading.Thread(target=post, args=(url, body)) for body in bodies]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    stop.set()
    scraper.join()


def post(url: str, body: dict) -> None:
    with httpx.Client(base_url=url, timeout=300) as http:
        http.post("/v1/completions", json=body).raise_for_status()


def scrape(url: str, interval: float, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.wait(interval):
            http.get("/metrics").raise_for_status()
            http.get("/v1/pool").raise_for_status()


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--scrape-interval", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=8, help=f"at least {MIN_ROUNDS}")
    parser.add_argument("--torch-threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: fewer pairs say little")
    threads = args.torch_threads or default_torch_threads()
    torch.set_num_threads(threads)  # as kvctl-agent does; the same for both sides
    print(command_line())
    print(environment())
    print(f"torch threads: {threads} (kvctl-agent's default: cores - 1)")
    _, model, tokenizer = build_demo_model()
    paired = paired_rounds(
        lambda: median_ms(in_agent(model, tokenizer, args)),
        lambda: median_ms(alone(model, tokenizer, args)),
        args.rounds,
    )
    overheads = [100 * (r - 1) for r in paired.ratios]
    print(f"batch {BATCH}, prompt {args.prompt_tokens}, {args.max_tokens} new tokens each")
    print(f"engine alone: {spread(paired.base)} ms/step (median (min-max) of rounds)")
    print(f"inside agent: {spread(paired.ours)} ms/step (median (min-max) of rounds)")
    print(
        f"overhead: {statistics.median(overheads):+5.1f} % (median of {args.rounds} paired "
        f"rounds; per round {min(overheads):+.1f} % to {max(overheads):+.1f} %; target under 2 %)"
    )
    print(load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main())
