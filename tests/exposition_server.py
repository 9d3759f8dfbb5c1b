"""One HTTP server standing in for a fleet: recorded expositions served as any number of nodes.

A fleet of hundreds of nodes cannot be started on one machine, but Prometheus and `kvctl status`
only see what the nodes answer. Here node `n` of kind `kvctl`, `vllm`, `sglang` or `trtllm`
answers with that engine's recorded exposition (tests/fixtures/expositions), its names, types
and labels unchanged and its values varied by `n`, so that every row of a fleet table differs:

- a gauge that is a ratio is scaled by a per-node factor in 0.25..1, so it stays in 0..1 (a
  success ratio's shortfall is scaled instead, by 0.5..1.5, so it stays near 1); other gauges
  by a per-node factor in 0.5..1.5, whole ones rounded, so counts stay whole and at least 0
  (and one node's page counts keep their proportions);
- a counter, histogram bucket, count and sum is `base + n + (base + 10) * g_n * t`, `t` the
  seconds since the server started and `g_n` a per-node growth (0.2..1 % a second), floored
  where it was whole: it only grows, so `rate()` is not zero, and the rate of hits over that
  of queries stays in 0..1;
- timestamps (`*_created`, the start time), info series, configuration (page size, tokens per
  block) and NaN are as recorded.

Routes, for node `n` (any whole number) and kind `K`:

- `GET /node/{n}/{K}/metrics` (TensorRT-LLM: `/node/{n}/trtllm/prometheus/metrics`, its
  `/metrics` answering JSON as trtllm-serve's does), and `GET /metrics?node=N&kind=K` (what a
  Prometheus target with `__param_node` and `__param_kind` labels asks);
- kind `kvctl` also answers the agent API `kvctl status` reads, under `/node/{n}/kvctl/`:
  `/healthz`, `/v1/pools`, `/v1/pool` and `/v1/alerts`, as kvctl.api models built from
  tests/pool_readings.py's pool varied by `n`; another route is the agent's own 404.

The exposition of each kind is parsed once into a template, and a node's gauges are filled in
once, so an answer formats only its counters: 500 targets every 5 s cost a few percent of a core.

    python tests/exposition_server.py [--port 8600] [--kinds kvctl vllm sglang trtllm]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from pool_readings import pool_snapshot

from kvctl import __version__
from kvctl.api import Alert, AlertList, ErrorBody, Health, PoolList, PoolSnapshot

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "expositions"
FILES = {
    "kvctl": "kvctl-0.1.0-busy.txt",
    "vllm": "vllm-0.32.0-busy.txt",
    "sglang": "sglang-0.5.23-from-source.txt",
    "trtllm": "trtllm-main-050f80de-from-source.txt",
}
KINDS = tuple(FILES)
METRICS_PATHS = {"trtllm": "/prometheus/metrics"}
"""Where a kind serves its Prometheus text, where not /metrics."""

PHI = (math.sqrt(5) - 1) / 2
"""Multiples of it modulo 1 spread evenly over 0..1: node factors that differ for every node."""
GROWTH = 0.002
"""A counter of node n grows by (base + LIFT) * GROWTH * (1 + n % 5) per second."""
LIFT = 10.0
"""So that a counter recorded at 0 grows too (preemptions), yet hits stay below queries."""

_RATIO = re.compile(r"(ratio|_perc|usage|utilization|hit_rate|_rate|occupancy)$")
_CONSTANT = re.compile(
    r"(_info|_created|start_time_seconds|page_size(_tokens)?|tokens_per_block|max_fds"
    r"|context_len|is_cuda_graph|sleep_state)$"
)
_SUCCESS = re.compile(r"success")
_GROWING = frozenset({"counter", "histogram", "summary"})

RATIO, SUCCESS, AMOUNT, COUNTER = "ratio", "success", "amount", "counter"


def ratio_scale(node: int) -> float:
    """0.25..1: what node `node` multiplies its ratio gauges by."""
    return 0.25 + 0.75 * ((node * PHI) % 1.0)


def amount_scale(node: int) -> float:
    """0.5..1.5: what node `node` multiplies its other gauges by."""
    return 0.5 + ((node * PHI + 0.5) % 1.0)


def growth(node: int) -> float:
    return GROWTH * (1 + node % 5)


def counter_value(base: float, whole: bool, node: int, elapsed: float) -> float:
    """A counter of node `node`, `elapsed` seconds after the server started."""
    value = base + node + (base + LIFT) * growth(node) * elapsed
    return float(math.floor(value)) if whole else value


def gauge_value(rule: str, base: float, whole: bool, node: int) -> float:
    if rule == RATIO:
        return base * ratio_scale(node)
    if rule == SUCCESS:
        return max(0.0, 1.0 - (1.0 - base) * amount_scale(node))
    value = base * amount_scale(node)
    return float(round(value)) if whole else value


def _number(value: float) -> str:
    if math.isfinite(value):
        return repr(value)
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


@dataclass(frozen=True)
class Slot:
    """A sample value that varies: how, from what, and whether it was a whole number."""

    rule: str
    base: float
    whole: bool


def _rule(kind: str | None, name: str, value: float) -> str | None:
    """How a sample of family type `kind` varies by node; None: it is as recorded."""
    if math.isnan(value) or _CONSTANT.search(name) or kind in ("info", "stateset"):
        return None
    if kind in _GROWING:
        return COUNTER
    if _RATIO.search(name) and 0.0 <= value <= 1.0:
        return SUCCESS if _SUCCESS.search(name) else RATIO
    return AMOUNT


class Template:
    """An exposition split into the text that never changes and the values that do."""

    def __init__(self, text: str) -> None:
        pieces: list[str] = []
        slots: list[Slot] = []
        literal: list[str] = []
        family_type: str | None = None
        for line in text.splitlines(keepends=True):
            if line.startswith("#") or not line.strip():
                parts = line.split()
                if len(parts) >= 4 and parts[1] == "TYPE":
                    family_type = parts[3]
                literal.append(line)
                continue
            head, _, rest = line.rstrip("\n").rpartition(" ")
            value = float(rest)
            name = head.split("{", 1)[0]
            rule = _rule(family_type, name, value)
            if rule is None:
                literal.append(line)
                continue
            literal.append(head + " ")
            pieces.append("".join(literal))
            literal = ["\n"]
            slots.append(Slot(rule, value, math.isfinite(value) and value == int(value)))
        pieces.append("".join(literal))
        self.pieces = tuple(pieces)
        self.slots = tuple(slots)

    def for_node(self, node: int) -> NodeTemplate:
        """The exposition with node `node`'s gauges filled in; its counters left to fill."""
        static: list[str] = [self.pieces[0]]
        counters: list[tuple[float, bool]] = []
        for slot, piece in zip(self.slots, self.pieces[1:], strict=True):
            if slot.rule == COUNTER:
                counters.append((slot.base, slot.whole))
                static.append(piece)
            else:
                value = gauge_value(slot.rule, slot.base, slot.whole, node)
                static[-1] += _number(value) + piece
        return NodeTemplate(node, tuple(static), tuple(counters))


@dataclass(frozen=True)
class NodeTemplate:
    node: int
    static: tuple[str, ...]
    counters: tuple[tuple[float, bool], ...]

    def render(self, elapsed: float) -> str:
        node = self.node
        out = [self.static[0]]
        for (base, whole), text in zip(self.counters, self.static[1:], strict=True):
            out.append(repr(counter_value(base, whole, node, elapsed)))
            out.append(text)
        return "".join(out)


@cache
def template(kind: str) -> Template:
    return Template((FIXTURES / FILES[kind]).read_text())


@lru_cache(maxsize=4096)
def node_template(kind: str, node: int) -> NodeTemplate:
    return template(kind).for_node(node)


def exposition(kind: str, node: int, elapsed: float) -> str:
    """What node `node` of kind `kind` answers on its metrics path `elapsed` s after start."""
    return node_template(kind, node).render(elapsed)


# ---- the kvctl agent's API ---------------------------------------------------------------------


def agent_pool(node: int, elapsed: float, now: float | None = None) -> PoolSnapshot:
    """Node `node`'s pool, varied as its exposition is (its counters growing with `elapsed`)."""
    share = (node * PHI) % 1.0
    other = (node * PHI + 0.5) % 1.0
    capacity = 512 * (1 + node % 4)
    used = round(capacity * (0.15 + 0.8 * share))
    cached = round((capacity - used) * 0.4 * other)
    queries = 10_000 + 100 * node + math.floor(20_000 * growth(node) * elapsed)
    hits = math.floor(queries * (0.3 + 0.6 * other))
    failures = 0 if node % 13 else 12
    return pool_snapshot(
        fragmentation=0.02 + 0.5 * other,
        timestamp=time.time() if now is None else now,
        capacity_pages=capacity,
        used_pages=used,
        cached_pages=cached,
        alloc_attempts_total=1_000 + 10 * node,
        alloc_failures_total=failures,
        alloc_success_ratio=1.0 - failures / 400,
        window_alloc_failures=failures,
        prefix_queries_tokens_total=queries,
        prefix_hits_tokens_total=hits,
        prefix_hit_ratio=hits / queries,
        requests_running=node % 9,
        requests_waiting=node % 4 if share > 0.7 else 0,
        preemptions_total=node % 7 + math.floor(LIFT * growth(node) * elapsed),
    )


def agent_answer(node: int, route: str, elapsed: float) -> tuple[int, str]:
    """(status, JSON body) of node `node`'s agent for `route` (`/v1/pools`)."""
    pool = agent_pool(node, elapsed)
    if route == "/healthz":
        health = Health(
            status="ok",
            pool=pool.pool,
            version=__version__,
            uptime_seconds=3_600 + 10 * node + elapsed,
            pools=[pool.pool],
        )
        return 200, health.model_dump_json()
    if route == "/v1/pools":
        return 200, PoolList(pools=[pool]).model_dump_json()
    if route == "/v1/pool":
        return 200, pool.model_dump_json()
    if route == "/v1/alerts":
        alerts = []
        if pool.pressure_ratio > 0.9:
            alerts.append(
                Alert(
                    name="KvctlPoolNearlyFull",
                    severity="warning",
                    state="firing",
                    value=pool.pressure_ratio,
                    summary=f"pool {pool.pool} is {pool.pressure_ratio:.0%} held by requests",
                    description="",
                    remediation="grow the pool or shed load",
                    runbook_url="http://127.0.0.1/runbook#kvctlpoolnearlyfull",
                    active_since=time.time() - 60,
                    labels={"pool": pool.pool},
                )
            )
        return 200, AlertList(alerts=alerts).model_dump_json()
    error = {"message": f"no route GET {route}", "type": "not_found", "code": 404}
    return 404, ErrorBody.model_validate({"error": error}).model_dump_json()


# ---- the server --------------------------------------------------------------------------------

_NODE_PATH = re.compile(r"^/node/(?P<node>\d+)/(?P<kind>[a-z]+)(?P<rest>/.*)?$")


def node_url(base: str, node: int, kind: str) -> str:
    """The base URL of node `node` of kind `kind` (what `kvctl status -a` is given)."""
    return f"{base}/node/{node}/{kind}"


def metrics_path(node: int, kind: str) -> str:
    """The path Prometheus scrapes node `node` of kind `kind` at."""
    return f"/node/{node}/{kind}{METRICS_PATHS.get(kind, '/metrics')}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Prometheus and httpx expect
    disable_nagle_algorithm = True  # headers and body in one packet, not 40 ms apart
    server: _Server

    def do_GET(self) -> None:
        status, content_type, body = self.server.answer(self.path)
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        """Quiet: hundreds of scrapes a second."""


TEXT = "text/plain; version=0.0.4; charset=utf-8"
JSON = "application/json"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # hundreds of nodes read at once connect at once
    answer: Callable[[str], tuple[int, str, str]]


class ExpositionServer:
    """The server, in a thread of this process; `url` is its base URL once started."""

    def __init__(
        self,
        kinds: Iterable[str] = KINDS,
        port: int = 0,
        host: str = "127.0.0.1",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kinds = tuple(kinds)
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)}: expected some of {KINDS}")
        self.clock = clock
        self.started = clock()
        self.paths: list[str] = []
        """Every request target answered, in order (what a client asked of the fleet)."""
        self._server = _Server((host, port), _Handler)
        self._server.answer = self.answer
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        for kind in self.kinds:
            template(kind)  # parse before the first scrape

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> ExpositionServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> ExpositionServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def elapsed(self) -> float:
        return self.clock() - self.started

    def answer(self, target: str) -> tuple[int, str, str]:
        """(status, content type, body) for the request target `target` (path and query)."""
        self.paths.append(target)
        parts = urlsplit(target)
        path = parts.path
        if path in ("/metrics", "/prometheus/metrics") and parts.query:
            query = parse_qs(parts.query)
            node, kind = query.get("node", [""])[0], query.get("kind", [""])[0]
            if node.isdigit() and kind in self.kinds:
                return 200, TEXT, exposition(kind, int(node), self.elapsed())
            return 404, TEXT, f"no node {node!r} of kind {kind!r}\n"
        match = _NODE_PATH.match(path)
        if match is None or match["kind"] not in self.kinds:
            return 404, TEXT, f"no such node: {path}\n"
        node, kind, rest = int(match["node"]), match["kind"], match["rest"] or "/"
        if rest == METRICS_PATHS.get(kind, "/metrics"):
            return 200, TEXT, exposition(kind, node, self.elapsed())
        if kind == "trtllm" and rest == "/metrics":
            return 200, JSON, "[]"  # trtllm-serve's iteration stats, not Prometheus text
        if kind == "kvctl":
            status, body = agent_answer(node, rest, self.elapsed())
            return status, JSON, body
        return 404, JSON, json.dumps({"detail": "Not Found"})  # FastAPI's, as vLLM answers


def start(kinds: Iterable[str] = KINDS, port: int = 0, host: str = "127.0.0.1") -> ExpositionServer:
    """A started server (stop it, or use it as a context manager); `.url` is its base URL."""
    return ExpositionServer(kinds, port, host).start()


@contextmanager
def serve(kinds: Iterable[str] = KINDS, port: int = 0) -> Iterator[str]:
    """The base URL of a server running for the `with` block."""
    with start(kinds, port) as server:
        yield server.url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8600)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    args = parser.parse_args()
    server = start(args.kinds, args.port, args.host)
    print(f"serving {', '.join(server.kinds)} nodes at {server.url}/node/N/KIND", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
