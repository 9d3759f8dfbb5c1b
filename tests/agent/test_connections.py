"""The agent's listening socket and connection limits, on a real socket in this process."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from fastapi import FastAPI, Request

from kvctl.agent.connections import bounded_protocol, listening_socket


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
