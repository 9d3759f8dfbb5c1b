"""A recorded fake of the levers of vLLM 0.32 and SGLang: a real HTTP server on 127.0.0.1 that
answers their routes with the statuses and bodies the real servers give, and keeps their state
(asleep or not, a prefix cache that requests still hold).

vLLM's answers were recorded from its CPU build by benchmarks/engine_levers_vllm.py (the run is
in docs/engines.md): without VLLM_SERVER_DEV_MODE every lever route is FastAPI's 404; with it,
`POST /reset_prefix_cache` is `{"success":true}` (false while running requests hold blocks),
`POST /sleep?level=N` `{"status":"sleeping","level":N}` (a level outside 0..2 a 400 in
OpenAI's error shape), `POST /wake_up` `{"status":"awake","tags":null}`, `GET /is_sleeping`
`{"is_sleeping":B}`, a GET of a POST route 405, and `GET /server_info?config_format=json` says
`enable_sleep_mode` under `vllm_config.model_config`. SGLang's are as its http_server.py
defines them (it needs a GPU): `/flush_cache` (GET or POST) answers text, 200 or 400 with the
same words; `/release_memory_occupation` and `/resume_memory_occupation` a JSON `null`;
`/get_server_info` its server arguments, `enable_memory_saver` among them.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
NOT_FOUND = (404, JSON, '{"detail":"Not Found"}')
NOT_ALLOWED = (405, JSON, '{"detail":"Method Not Allowed"}')
SGLANG_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)

Answer = tuple[int, str, str]


@dataclass
class EngineState:
    """What the fake engine was started with and what it is now."""

    engine: str = "vllm"
    dev_mode: bool = True
    """vLLM: VLLM_SERVER_DEV_MODE=1 (its lever routes exist)."""
    sleep_mode: bool = True
    """vLLM: --enable-sleep-mode; SGLang: --enable-memory-saver."""
    busy: bool = False
    """Requests run: vLLM's reset answers success false, SGLang's flush 400."""
    sleeping: bool = False
    level: int = 0
    requests: list[tuple[str, str]] = field(default_factory=list)
    """Every (method, path with query) received, in order."""

    @property
    def sent(self) -> list[tuple[str, str]]:
        """The requests that could change something (every method but GET)."""
        return [r for r in self.requests if r[0] != "GET"]


def _json(data: object, status: int = 200) -> Answer:
    return status, JSON, json.dumps(data, separators=(",", ":"))


def vllm_answer(state: EngineState, method: str, path: str, query: dict[str, list[str]]) -> Answer:
    routes = {
        "/reset_prefix_cache": "POST",
        "/sleep": "POST",
        "/wake_up": "POST",
        "/is_sleeping": "GET",
        "/server_info": "GET",
    }
    if path == "/health" and method == "GET":
        return 200, JSON, ""
    if path not in routes or not state.dev_mode:
        return NOT_FOUND
    if method != routes[path]:
        return NOT_ALLOWED
    if path == "/reset_prefix_cache":
        return _json({"success": not state.busy})
    if path == "/sleep":
        level = int(query.get("level", ["1"])[0])
        if not 0 <= level <= 2:  # recorded: FastAPI's validation error in OpenAI's shape
            message = (
                "1 validation error:\n  {'type': 'less_than_equal', 'loc': 'query.level', "
                f"'msg': 'Input should be less than or equal to 2', 'input': '{level}', "
                "'ctx': {'le': 2}}"
            )
            error = {"message": message, "type": "Bad Request", "param": None, "code": 400}
            return _json({"error": error}, 400)
        state.sleeping, state.level = True, level  # vLLM pauses even without sleep mode
        return _json({"status": "sleeping", "level": level})
    if path == "/wake_up":
        state.sleeping, state.level = False, 0
        return _json({"status": "awake", "tags": None})
    if path == "/is_sleeping":
        return _json({"is_sleeping": state.sleeping})
    model_config = {"model": "/models/smollm", "enable_sleep_mode": state.sleep_mode}
    return _json(
        {
            "vllm_config": {"model_config": model_config, "cache_config": {"block_size": 32}},
            "vllm_env": {"VLLM_SERVER_DEV_MODE": True},
            "system_env": {"os": "Debian"},
        }
    )


def sglang_answer(state: EngineState, method: str, path: str) -> Answer:
    if path == "/flush_cache" and method in ("GET", "POST"):
        return (400 if state.busy else 200), TEXT, SGLANG_FLUSHED
    if path == "/release_memory_occupation" and method in ("GET", "POST"):
        state.sleeping = True
        return 200, JSON, "null"
    if path == "/resume_memory_occupation" and method in ("GET", "POST"):
        state.sleeping = False
        return 200, JSON, "null"
    if path == "/get_server_info" and method == "GET":
        return _json(
            {
                "model_path": "/models/smollm",
                "enable_memory_saver": state.sleep_mode,
                "version": "0.5.23",
            }
        )
    return NOT_FOUND


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer("POST")

    def _answer(self, method: str) -> None:
        state = self.server.state
        state.requests.append((method, self.path))
        parts = urlsplit(self.path)
        if state.engine == "vllm":
            status, kind, body = vllm_answer(state, method, parts.path, parse_qs(parts.query))
        else:
            status, kind, body = sglang_answer(state, method, parts.path)
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        """Quiet."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: EngineState


class LeverServer:
    """The fake in a thread of this process; `url` its base URL, `agent` the `--agent` form."""

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.state = state
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def agent(self) -> str:
        return f"{self.state.engine}+{self.url}"

    def __enter__(self) -> LeverServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
