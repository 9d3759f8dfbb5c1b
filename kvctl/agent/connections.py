"""Limits on client connections that uvicorn does not set by itself.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive` and answers 503 past
`limit_concurrency`, but it gives a client unlimited time to send a request: a connection that
sends nothing, or a byte a minute (slowloris), holds a socket and the server's memory forever.
`bounded_protocol` adds two deadlines to uvicorn's HTTP/1.1 protocol (h11): the request's
headers must arrive within `header_timeout` of the connection opening (or of the first byte
after an idle keep-alive pause), and its body within `body_timeout` of the headers. A connection
that misses one is closed. And when a new connection would pass `max_connections`, the oldest
idle keep-alive connections are closed, so idle clients cannot crowd out working ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines and a cap on idle connections."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 2048

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = ""  # "headers" or "body" while a deadline runs
        self._opened = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._opened = self.loop.time()
        self._close_idle_connections()
        self._arm("headers", self.header_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # uvicorn's keep-alive timer takes over until the next byte arrives

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    @property
    def idle(self) -> bool:
        """No request is being read or answered on this connection."""
        return self.cycle is None or self.cycle.response_complete

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

    def _close_idle_connections(self) -> None:
        excess = len(self.connections) - self.max_connections
        if excess <= 0:
            return
        idle = [
            other
            for other in self.connections
            if other is not self and isinstance(other, BoundedH11Protocol) and other.idle
        ]
        for other in sorted(idle, key=lambda protocol: protocol._opened)[:excess]:
            other._close()


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
