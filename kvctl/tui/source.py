"""Where the dashboard's data comes from, and where its actions go.

`DataSource` is the seam between the UI and the agents: `HttpSource` talks to real agents,
tests hand the app a fake with fixed readings. Every call is a coroutine, so the UI never
blocks on a slow or dead agent. On an agent that serves several models, a read shows (and maps)
the pool the app names for it, and the actions take the pool they act on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from kvctl.api import DefragResult, ResizeRequest, ResizeResult
from kvctl.client import DEFAULT_TIMEOUT, AsyncAgentClient
from kvctl.engines import KVCTL
from kvctl.fleet import Fleet, Reading
from kvctl.prometheus_fleet import PrometheusError, PrometheusFleet, unseen


class DataSource(Protocol):
    """Readings of a list of agents, and the two actions the dashboard can take."""

    @property
    def agents(self) -> Sequence[str]: ...

    @property
    def fleet_first(self) -> bool:
        """Open on the fleet table even with one node (its nodes are found, not given)."""
        ...

    async def read(
        self, pools: Mapping[str, str] | None = None, focus: str | None = None
    ) -> list[Reading]:
        """A reading of every agent; `pools` names the pool to show by agent URL, `focus` the
        agent whose detail is on screen (read in full where the source can)."""
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

    fleet_first = False

    @property
    def agents(self) -> Sequence[str]:
        return [client.url for client in self._fleet.clients]

    async def read(
        self, pools: Mapping[str, str] | None = None, focus: str | None = None
    ) -> list[Reading]:
        return await self._fleet.read(with_map=True, pools=pools)

    async def defrag(self, agent: str, pool: str | None = None) -> DefragResult:
        return await self._by_url[agent].defrag(pool=pool)

    async def resize(
        self, agent: str, request: ResizeRequest, pool: str | None = None
    ) -> ResizeResult:
        return await self._by_url[agent].resize(request, pool)

    async def close(self) -> None:
        await self._fleet.aclose()


class PrometheusSource:
    """The fleet as a Prometheus has it, and the node on the detail screen read directly.

    The rows come from a few queries per poll (`kvctl.prometheus_fleet`); the nodes are those
    Prometheus knows, so the list grows as targets appear, and a node no longer in its answer
    stays as a row that says so rather than its last figures. The node whose detail is open is
    also read straight from itself (its agent API, or an engine's /metrics), which gives the page
    map and the acting keys; when this machine cannot reach it, its row keeps Prometheus's
    figures and says why.
    """

    fleet_first = True

    def __init__(
        self,
        url: str,
        selector: str | None = None,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        first: Sequence[Reading] = (),
    ) -> None:
        self._prometheus = PrometheusFleet(url, selector, timeout)
        self._token, self._timeout = token, timeout
        self._agents: list[str] = list(dict.fromkeys(r.agent for r in first))
        self._direct: dict[str, Fleet] = {}

    @property
    def agents(self) -> Sequence[str]:
        return self._agents

    async def read(
        self, pools: Mapping[str, str] | None = None, focus: str | None = None
    ) -> list[Reading]:
        try:
            readings = await self._prometheus.read()
        except PrometheusError as error:
            return [unseen(agent, str(error), "Prometheus unreachable") for agent in self._agents]
        by_agent = {reading.agent: reading for reading in readings}
        self._agents.extend(agent for agent in by_agent if agent not in self._agents)
        if focus is not None and focus in by_agent:
            by_agent[focus] = await self._read_directly(by_agent[focus], pools)
        gone = "not in Prometheus's answer (target removed, or outside --selector)"
        return [
            by_agent.get(a) or unseen(a, f"{a}: {gone}", "gone from Prometheus")
            for a in self._agents
        ]

    async def _read_directly(self, seen: Reading, pools: Mapping[str, str] | None) -> Reading:
        """The node read from itself; Prometheus's reading, with why, when it does not answer."""
        fleet = self._direct.get(seen.agent)
        if fleet is None:
            url = seen.agent if seen.engine == KVCTL else f"{seen.engine}+{seen.agent}"
            fleet = self._direct[seen.agent] = Fleet([url], self._token, self._timeout)
        (direct,) = await fleet.read(with_map=True, pools=pools)
        if direct.up:
            return direct
        reason = direct.error.reason if direct.error else "no answer"
        note = f"not reachable from here ({reason}): the figures are Prometheus's"
        return replace(seen, notes=(note, *seen.notes))

    async def defrag(self, agent: str, pool: str | None = None) -> DefragResult:
        return await self._client(agent).defrag(pool=pool)

    async def resize(
        self, agent: str, request: ResizeRequest, pool: str | None = None
    ) -> ResizeResult:
        return await self._client(agent).resize(request, pool)

    def _client(self, agent: str) -> AsyncAgentClient:
        return self._direct[agent].clients[0]

    async def close(self) -> None:
        await self._prometheus.aclose()
        for fleet in self._direct.values():
            await fleet.aclose()
