"""A source that misbehaves on purpose, on 127.0.0.1: answers dripped a byte at a time, larger
than any real one, nested too deep, or full of NaN, by path; any other path is FastAPI's 404.

A kvctl node, an engine's /metrics, Prometheus and Alertmanager are all an HTTP answer to
kvctl, so one server stands in for each: `kvctl status --agent vllm+{url}/bad` reads
`/bad/metrics`, `--prometheus {url}/prom` reads `/prom/api/v1/query`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

TEXT = "text/plain; version=0.0.4; charset=utf-8"
JSON = "application/json"


@dataclass(frozen=True)
class Answer:
    body: bytes
    content_type: str = TEXT
    status: int = 200
    drip: float | None = None
    """Seconds between bytes of the body (its headers, with its full length, sent at once)."""
    drip_headers: bool = False
    """Drip the status line and headers too, not only the body."""


def nested(depth: int) -> bytes:
    """A Prometheus success answer whose result is a list nested `depth` levels deep."""
    return b'{"status":"success","data":{"resultType":"vector","result":%s}}' % (
        b"[" * depth + b"]" * depth
    )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer()

    def _answer(self) -> None:
        path = urlsplit(self.path).path
        answer = self.server.routes.get(path)
        if answer is None:
            answer = Answer(json.dumps({"detail": "Not Found"}).encode(), JSON, 404)
        head = (
            f"HTTP/1.1 {answer.status} X\r\nContent-Type: {answer.content_type}\r\n"
            f"Content-Length: {len(answer.body)}\r\n\r\n"
        ).encode()
        try:
            if answer.drip is None:
                self.wfile.write(head + answer.body)
                return
            data = head + answer.body
            if not answer.drip_headers:
                self.wfile.write(head)
                data = answer.body
            for i in range(len(data)):
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                time.sleep(answer.drip)
        except OSError:  # the client gave up: that is the point
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        """Quiet."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a fleet's or Prometheus' queries connect at once
    routes: Mapping[str, Answer]

    def handle_error(self, request: object, client_address: object) -> None:
        """Quiet: a client that hangs up on a hostile answer is what the tests expect."""


class HostileServer:
    """The server in a thread of this process; `url` is its base URL."""

    def __init__(self, routes: Mapping[str, Answer]) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.routes = routes
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HostileServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
