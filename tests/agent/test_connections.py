"""The agent's listening socket and connection limits, on a real socket in this process."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request

from kvctl.agent.http.connections import BoundedH11Protocol, bounded_protocol, listening_socket


def test_accepted_connections_have_nagle_off() -> None:
    """Without TCP_NODELAY every keep-alive answer waits ~40 ms for the client's delayed ACK."""
    sock = listening_socket("127.0.0.1", 0, 16)
    port = sock.getsockname()[1]
    flags: list[int] = []

    async def run() -> None:
        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            raw = writer.get_extra_info("socket")
            flags.append(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if flags:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(run())
    assert flags == [1]


def test_idle_keep_alive_connections_give_way_to_new_ones() -> None:
    """Past `max_connections`, the oldest idle keep-alive connections are closed first."""
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    server, sock, port = _bounded_server(app)

    async def run() -> list[bool]:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        clients = []
        for _ in range(24):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /ping HTTP/1.1\r\nHost: agent\r\n\r\n")
            await reader.readuntil(b'{"ok":true}')
            clients.append((reader, writer))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        closed = [reader.at_eof() or await _closed(reader) for reader, _ in clients]
        for _, writer in clients:
            writer.close()
        server.should_exit = True
        await serving
        return closed

    closed = asyncio.run(run())
    assert sum(closed) >= 8 and closed[:8] == [True] * 8  # the oldest idle ones went first
    assert closed[-1] is False


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 0.05) == b""
    except TimeoutError:
        return False


def test_busy_connections_get_503_but_health_probes_never_do() -> None:
    """With every connection carrying a request the application is working on, new requests
    are refused, except /healthz; connections still sending a body give way to new ones."""
    app = FastAPI()
    release = asyncio.Event()

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/work")
    async def work() -> dict:
        await release.wait()
        return {"ok": True}

    @app.post("/upload")
    async def upload(request: Request) -> dict:
        return {"size": len(await request.body())}

    server, sock, port = _bounded_server(app)

    async def status(path: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: agent\r\n\r\n".encode())
        line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        return line.split()[1]

    async def run() -> tuple[list[bytes], list[bytes], bool]:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        uploads = []
        for _ in range(8):  # headers in, body still to come: no work begun
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /upload HTTP/1.1\r\nHost: agent\r\nContent-Length: 100\r\n\r\nab")
            uploads.append((reader, writer))
        await asyncio.sleep(0.1)
        working = []
        for _ in range(16):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /work HTTP/1.1\r\nHost: agent\r\n\r\n")
            working.append((reader, writer))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        uploads_closed = all([reader.at_eof() or await _closed(reader) for reader, _ in uploads])
        busy = [await status("/work"), await status("/healthz")]
        release.set()
        done = [await asyncio.wait_for(reader.readline(), 5) for reader, _ in working]
        for _, writer in working + uploads:
            writer.close()
        server.should_exit = True
        await serving
        return busy, [line.split()[1] for line in done], uploads_closed

    busy, done, uploads_closed = asyncio.run(run())
    assert busy == [b"503", b"200"]
    assert done == [b"200"] * 16  # the work in progress was not cut off
    assert uploads_closed


def _bounded_server(app: FastAPI) -> tuple[uvicorn.Server, socket.socket, int]:
    """A uvicorn server for `app` with the agent's protocol at 16 connections, its socket and
    port (serve it with `server.serve(sockets=[sock])`)."""
    sock = listening_socket("127.0.0.1", 0, 64)
    config = uvicorn.Config(
        app,
        log_level="warning",
        http=bounded_protocol(header_timeout=30, body_timeout=30, max_connections=16),
        timeout_keep_alive=60,
    )
    return uvicorn.Server(config), sock, sock.getsockname()[1]


class HeldLoop:
    """An app whose `/block` holds the server's event loop (as a burst of work does) until
    `release()`, so that new connections and requests wait in the kernel meanwhile; the server
    runs in a thread, the test talks to it with blocking sockets."""

    def __init__(self, server_of: Callable[[FastAPI], tuple[uvicorn.Server, socket.socket, int]]):
        self.entered, self.gate = threading.Event(), threading.Event()
        self.before_release: Callable[[uvicorn.Server], None] = lambda _: None
        app = FastAPI()

        @app.get("/ping")
        async def ping() -> dict:
            return {"ok": True}

        @app.get("/block")
        async def block() -> dict:
            self.entered.set()
            self.gate.wait(5)
            self.before_release(self.server)
            return {"ok": True}

        self.server, sock, self.port = server_of(app)
        self.thread = threading.Thread(
            target=asyncio.run, args=(self.server.serve(sockets=[sock]),), daemon=True
        )

    def __enter__(self) -> HeldLoop:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self.gate.set()
        self.server.should_exit = True
        self.thread.join(10)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def hold(self) -> socket.socket:
        """Hold the loop; the connection that does it (answered on `release`)."""
        sock = self.connect()
        sock.sendall(b"GET /block HTTP/1.1\r\nHost: agent\r\n\r\n")
        assert self.entered.wait(5)
        return sock

    def release(self) -> None:
        self.gate.set()


def _ask(sock: socket.socket, path: str = "/ping") -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: agent\r\n\r\n".encode())
    return _answer(sock)


def _answer(sock: socket.socket) -> bytes:
    """The status of the answer on `sock`, b"reset" or b"closed" if there is none."""
    received = b""
    try:
        while b'{"ok":true}' not in received:
            chunk = sock.recv(4096)
            if not chunk:
                return b"closed"
            received += chunk
    except ConnectionResetError:
        return b"reset"
    return received.split()[1]


def _was_closed(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_request_waiting_unread_in_the_socket_is_never_closed_to_make_room() -> None:
    """A probe accepted in the same batch as a flood of idle connections used to count as idle
    while its request still sat in the socket buffer: closed first as the oldest, it was reset."""
    with HeldLoop(_bounded_server) as agent:
        blocker = agent.hold()
        probe = agent.connect()
        probe.sendall(b"GET /ping HTTP/1.1\r\nHost: agent\r\n\r\n")
        idle = [agent.connect() for _ in range(40)]
        agent.release()
        assert _answer(blocker) == b"200"
        assert _answer(probe) == b"200"
        assert sum(_was_closed(sock) for sock in idle) == 40 + 2 - 16
        for sock in [blocker, probe, *idle]:
            sock.close()


def test_answered_keep_alive_connections_go_last_and_a_batch_closes_only_what_it_must() -> None:
    """A scraper's keep-alive connection used to be closed before newer idle ones, and each
    connection of one accept batch counted the ones still closing, closing ever more."""
    with HeldLoop(_bounded_server) as agent:
        scraper = agent.connect()
        assert _ask(scraper) == b"200"
        blocker = agent.hold()
        fresh = [agent.connect() for _ in range(20)]
        agent.release()
        assert _answer(blocker) == b"200"
        time.sleep(0.2)
        closed = [_was_closed(sock) for sock in fresh]
        assert closed == [True] * 6 + [False] * 14  # 22 connections, 16 allowed: oldest first
        assert _ask(scraper) == b"200"
        for sock in [scraper, blocker, *fresh]:
            sock.close()


def test_the_keep_alive_timeout_spares_a_request_waiting_unread() -> None:
    """A keep-alive timer due while the loop was busy closed a connection whose next request,
    sent in time, was still in the socket buffer: the client saw a reset."""
    with HeldLoop(_bounded_server) as agent:
        scraper = agent.connect()
        assert _ask(scraper) == b"200"
        blocker = agent.hold()
        scraper.sendall(b"GET /ping HTTP/1.1\r\nHost: agent\r\n\r\n")

        def keep_alive_timers_fire(server: uvicorn.Server) -> None:
            for connection in list(server.server_state.connections):
                if isinstance(connection, BoundedH11Protocol) and connection.idle:
                    connection.timeout_keep_alive_handler()

        agent.before_release = keep_alive_timers_fire
        agent.release()
        assert _answer(blocker) == b"200"
        assert _answer(scraper) == b"200"
        scraper.close()
        blocker.close()
