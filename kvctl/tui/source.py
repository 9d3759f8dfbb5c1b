"""Where the dashboard's data comes from, and where its actions go.

`DataSource` is the seam between the UI and the agents: `HttpSource` talks to real agents,
tests hand the app a fake with fixed readings. Every call is a coroutine, so the UI never
blocks on a slow or dead agent. On an agent that serves several models, a read shows (and maps)
the pool the app names for it, and the actions take the pool they act on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from kvctl.api import DefragResult, ResizeRequest, ResizeResult
from kvctl.client import DEFAULT_TIMEOUT
from kvctl.fleet import Fleet, Reading


class DataSource(Protocol):
    """Readings of a fixed list of agents, and the two actions the dashboard can take."""

    @property
    def agents(self) -> Sequence[str]: ...

    async def read(self, pools: Mapping[str, str] | None = None) -> list[Reading]:
        """A reading of every agent; `pools` names the pool to show by agent URL."""
        ...

    async def defrag(self, agent: str, pool: str | None = None) -> DefragResult: ...

    async def resize(
        self, agent: str, request: ResizeRequest, pool: str | None = None
    ) -> ResizeResult: ...

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

    async def read(self, pools: Mapping[str, str] | None = None) -> list[Reading]:
        return await self._fleet.read(with_map=True, pools=pools)

    async def defrag(self, agent: str, pool: str | None = None) -> DefragResult:
        return await self._by_url[agent].defrag(pool=pool)

    async def resize(
        self, agent: str, request: ResizeRequest, pool: str | None = None
    ) -> ResizeResult:
        return await self._by_url[agent].resize(request, pool)

    async def close(self) -> None:
        await self._fleet.aclose()
