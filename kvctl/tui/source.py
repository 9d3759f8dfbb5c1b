"""Where the dashboard's data comes from, and where its actions go.

`DataSource` is the seam between the UI and the agents: `HttpSource` talks to real agents,
tests hand the app a fake with fixed readings. Every call is a coroutine, so the UI never
blocks on a slow or dead agent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvctl.api import DefragResult, ResizeRequest, ResizeResult
from kvctl.client import DEFAULT_TIMEOUT
from kvctl.fleet import Fleet, Reading


class DataSource(Protocol):
    """Readings of a fixed list of agents, and the two actions the dashboard can take."""

    @property
    def agents(self) -> Sequence[str]: ...

    async def read(self) -> list[Reading]: ...

    async def defrag(self, agent: str) -> DefragResult: ...

    async def resize(self, agent: str, request: ResizeRequest) -> ResizeResult: ...

    async def close(self) -> None: ...


class HttpSource:
    """Real agents over HTTP; one connection pool per agent, kept between polls."""

    def __init__(
        self, urls: Sequence[str], token: str | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self._fleet = Fleet(urls, token, timeout)
        self._by_url = {client.url: client for client in self._fleet.clients}

    @property
    def agents(self) -> Sequence[str]:
        return [client.url for client in self._fleet.clients]

    async def read(self) -> list[Reading]:
        return await self._fleet.read(with_map=True)

    async def defrag(self, agent: str) -> DefragResult:
        return await self._by_url[agent].defrag()

    async def resize(self, agent: str, request: ResizeRequest) -> ResizeResult:
        return await self._by_url[agent].resize(request)

    async def close(self) -> None:
        await self._fleet.aclose()
