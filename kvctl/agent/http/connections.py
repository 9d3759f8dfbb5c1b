"""Limits on client connections that uvicorn does not set by itself.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive` and answers 503 past
`limit_concurrency`, but it gives a client unlimited time to send a request: a connection that
sends nothing, or a byte a minute (slowloris), holds a socket and the server's memory forever.
`bounded_protocol` adds two deadlines to uvicorn's HTTP/1.1 protocol (h11): the request's
headers must arrive within `header_timeout` of the connection opening (or of the first byte
after an idle keep-alive pause), and its body within `body_timeout` of the headers. A connection
that misses one is closed.

And idle clients cannot crowd out working ones. When a new connection takes the count past
`max_connections`, connections that wait on their client are closed to make room, in this
order: those that never sent a byte (oldest first), then those still sending a request, then
idle keep-alive ones that have been answered (least recently active first), so a scraper's or a
client's keep-alive connection goes only once no idle flood connection is left. A connection
whose request has arrived is never closed, even while its bytes still wait in the kernel's
socket buffer for a busy event loop to read them (closing it then would reset it, RST, instead
of answering), and uvicorn's keep-alive timeout spares it too. Connections already closing do
not count, or one accept batch closed far more than it needed. Only when no connection can be
closed, with every one carrying a request the agent is working on, are new requests answered
503; `/healthz` never is, so a liveness probe cannot be failed by a flood. uvicorn's own
`limit_concurrency` is not used: it counts idle connections too, and answered 503 to
everything, probes included, one connection before the idle ones were closed.

The limit must also fit the process's file descriptors, or `accept()` fails first (EMFILE) and
asyncio logs a traceback for every attempt: `fit_connections_to_file_limit` raises the soft
limit to the hard one and lowers `max_connections` to what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable, Set
from typing import Any

import h11
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    import fcntl
    import termios

    _FIONREAD: int | None = termios.FIONREAD
except ImportError:  # not POSIX: no way to look into the socket's buffer
    _FIONREAD = None

log = logging.getLogger("kvctl.agent")

# Paths answered even when every connection is busy: what probes and load balancers ask.
UNLIMITED_PATHS = frozenset({"/healthz"})
# File descriptors kept for everything but client connections: checkpoint and tier files,
# the GPU driver, outgoing HTTP (Alertmanager), logs.
RESERVED_FILES = 128


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines and a cap on idle connections."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 2048

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # uvicorn's check counts idle connections; ours does not
        self.app = BusyLimit(self.app, self._make_room, self.tasks, self.max_connections)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = ""  # "headers" or "body" while a deadline runs
        self._opened = 0.0
        self._active = 0.0  # when its last response was complete
        self._heard = False  # a byte has arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # a TCP server's protocol is always given a Transport
        super().connection_made(transport)
        self._opened = self.loop.time()
        self._make_room()
        self._arm("headers", self.header_timeout)

    def data_received(self, data: bytes) -> None:
        self._heard = True
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._active = self.loop.time()
        self._disarm()  # uvicorn's keep-alive timer takes over until the next byte arrives

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's keep-alive timeout, unless the next request has arrived and waits for a
        busy loop to read it: closing then would reset a request sent in time."""
        if not unread_bytes(self.transport):
            super().timeout_keep_alive_handler()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    @property
    def idle(self) -> bool:
        """No request is being read or answered on this connection."""
        return self.cycle is None or self.cycle.response_complete

    @property
    def waiting_on_client(self) -> bool:
        """Idle, or its request still arriving: closing it loses no work the agent has begun."""
        return self.idle or self._phase == "body"

    def _follow_request(self) -> None:
        """Set the deadline that fits where the current request stands."""
        if self.transport.is_closing():
            return
        if self.idle:  # bytes of the next request, headers not complete yet
            if self._phase != "headers":
                self._arm("headers", self.header_timeout)
        elif self.cycle.more_body:
            if self._phase != "body":
                self._arm("body", self.body_timeout)
        else:  # the whole request is in: the application has it
            self._disarm()

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, ""

    def _expire(self) -> None:
        self._deadline, self._phase = None, ""
        self._close()

    def _close(self) -> None:
        if self.transport.is_closing():
            return
        # mid-request h11 cannot close cleanly; the socket still can
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    def _room_order(self) -> tuple[int, float]:
        """Where this connection stands among those closed to make room, first to last."""
        if not self._heard:
            return (0, self._opened)
        if self._phase:  # headers or body on the way
            return (1, self._opened)
        return (2, self._active)  # answered, idle keep-alive

    def _make_room(self) -> bool:
        """Close connections that wait on their client, in `_room_order`, until the count is
        back at the limit; False if it could not be."""
        if len(self.connections) <= self.max_connections:
            return True
        live = [other for other in self.connections if not other.transport.is_closing()]
        excess = len(live) - self.max_connections
        waiting = [
            other
            for other in live
            if other is not self
            and isinstance(other, BoundedH11Protocol)
            and other.waiting_on_client
        ]
        waiting.sort(key=BoundedH11Protocol._room_order)
        for other in waiting:
            if excess <= 0:
                break
            if not unread_bytes(other.transport):  # else its request has arrived, unread
                other._close()
                excess -= 1
        return excess <= 0


class BusyLimit:
    """The ASGI application behind a 503 for new requests while more than `limit` connections
    are open and none can be closed (`make_room`), or more than `limit` requests are in
    progress; `UNLIMITED_PATHS` always pass."""

    def __init__(
        self, app: Any, make_room: Callable[[], bool], tasks: Set[Any], limit: int
    ) -> None:
        self.app, self.make_room, self.tasks, self.limit = app, make_room, tasks, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        busy = len(self.tasks) > self.limit or not self.make_room()
        if busy and scope.get("path") not in UNLIMITED_PATHS:
            await service_unavailable(scope, receive, send)
            return
        await self.app(scope, receive, send)


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for this connection that the event loop has not read yet;
    0 where that cannot be asked (not Linux or BSD, or the socket is gone)."""
    sock = transport.get_extra_info("socket")
    if sock is None or _FIONREAD is None:
        return 0
    try:
        count = fcntl.ioctl(sock.fileno(), _FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", count)[0])


def bounded_protocol(
    header_timeout: float, body_timeout: float, max_connections: int
) -> type[BoundedH11Protocol]:
    """A protocol class for `uvicorn.Config(http=...)` with these limits."""
    return type(
        "AgentH11Protocol",
        (BoundedH11Protocol,),
        {
            "header_timeout": header_timeout,
            "body_timeout": body_timeout,
            "max_connections": max_connections,
        },
    )


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A bound, listening TCP socket for uvicorn (`serve(sockets=[...])`); raises OSError.

    Its protocol is IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    on connections whose socket says TCP, and with Nagle on, every answer on a keep-alive
    connection and every streamed token waited for the client's delayed ACK (about 40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(min(backlog, 4096))
    except OSError:
        sock.close()
        raise
    return sock


def fit_connections_to_file_limit(max_connections: int) -> tuple[int, int]:
    """Raise the soft file limit to the hard one; return (max_connections, backlog) that fit
    the descriptors left after those open now and `RESERVED_FILES`, with a warning if lowered.

    The backlog counts too: asyncio accepts up to `backlog` connections in one go before any
    it closes to make room have let go of their descriptors."""
    backlog = min(max_connections, 4096)
    try:
        import resource
    except ImportError:  # not on POSIX: nothing to read or raise
        return max_connections, backlog
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    room = soft - _open_files() - RESERVED_FILES
    if soft == resource.RLIM_INFINITY or max_connections + backlog <= room:
        return max_connections, backlog
    backlog = max(16, min(backlog, room // 8))
    fitted = max(1, room - backlog)
    log.warning(
        "max_connections %d lowered to %d (backlog %d): the file limit is %d descriptors; "
        "raise it (systemd LimitNOFILE=, docker --ulimit nofile=) to accept more connections",
        max_connections,
        fitted,
        backlog,
        soft,
    )
    return fitted, backlog


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64  # no /proc: a typical count at start-up


class _OnePerInterval(logging.Filter):
    """Lets asyncio's `accept()` failure through once per `interval` seconds, without its
    traceback and with the count since: it repeats for every connection attempt while file
    descriptors are exhausted (tens of thousands of tracebacks a second)."""

    interval = 10.0

    def __init__(self) -> None:
        super().__init__()
        self.last = float("-inf")
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("socket.accept() out of system resource"):
            return True
        if record.created - self.last < self.interval:
            self.dropped += 1
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg = f"accepting connections failed: {error}; {self.dropped} more since"
        record.args, record.exc_info, record.exc_text = (), None, None
        self.last, self.dropped = record.created, 0
        return True


def quiet_accept_errors() -> None:
    """Install `_OnePerInterval` on asyncio's logger (once)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(known, _OnePerInterval) for known in logger.filters):
        logger.addFilter(_OnePerInterval())
