"""One reading of each agent in a fleet: health, pool, alerts (and the page map on request).

`kvctl status`, `kvctl top --once/--headless` and the TUI all show the same `Reading`, so a
number means the same thing on every screen. Agents are read concurrently: one agent that hangs
costs the fleet one timeout, not one timeout per agent. A reading that failed keeps the error,
so an unreachable agent is a row in the fleet table rather than an exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvctl.api import Alert, Health, PoolMap, PoolSnapshot
from kvctl.client import DEFAULT_TIMEOUT, AgentError, AsyncAgentClient


@dataclass(frozen=True)
class Reading:
    """What one agent said at one moment, or why it said nothing."""

    agent: str
    health: Health | None = None
    pool: PoolSnapshot | None = None
    alerts: tuple[Alert, ...] = ()
    map: PoolMap | None = None
    error: AgentError | None = None

    @property
    def up(self) -> bool:
        return self.error is None and self.pool is not None

    @property
    def firing(self) -> tuple[Alert, ...]:
        return tuple(alert for alert in self.alerts if alert.state == "firing")

    def to_json(self) -> dict[str, Any]:
        """The stable `kvctl status --json` entry: api models as JSON, the error as its line."""
        return {
            "agent": self.agent,
            "up": self.up,
            "error": None if self.error is None else str(self.error),
            "health": _dump(self.health),
            "pool": _dump(self.pool),
            "alerts": [alert.model_dump(mode="json") for alert in self.alerts],
        }


def _dump(model: Any) -> Any:
    return None if model is None else model.model_dump(mode="json")


async def read_agent(client: AsyncAgentClient, with_map: bool = False) -> Reading:
    """Health, pool and alerts of one agent (and its map), read concurrently."""
    calls = [client.health(), client.pool(), client.alerts()]
    if with_map:
        calls.append(client.pool_map())
    try:
        health, pool, alerts, *rest = await asyncio.gather(*calls)
    except AgentError as error:
        return Reading(agent=client.url, error=error)
    page_map = rest[0] if rest else None
    if page_map is not None and page_map.pool is not None:
        pool = page_map.pool  # one moment for the numbers and the map
    return Reading(
        agent=client.url,
        health=health,
        pool=pool,
        alerts=tuple(alerts.alerts),
        map=page_map,
    )


async def read_fleet(clients: Sequence[AsyncAgentClient], with_map: bool = False) -> list[Reading]:
    """One reading per client, in the order given."""
    return list(await asyncio.gather(*(read_agent(c, with_map) for c in clients)))


@dataclass
class Fleet:
    """Async clients for a list of agent URLs, opened once and reused between polls."""

    urls: Sequence[str]
    token: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    clients: list[AsyncAgentClient] = field(init=False)

    def __post_init__(self) -> None:
        self.clients = [AsyncAgentClient(url, self.token, self.timeout) for url in self.urls]

    async def read(self, with_map: bool = False) -> list[Reading]:
        return await read_fleet(self.clients, with_map)

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self.clients))


def read_fleet_once(
    urls: Sequence[str], token: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> list[Reading]:
    """A blocking read of every agent, for commands that print once and exit."""

    async def read() -> list[Reading]:
        fleet = Fleet(urls, token, timeout)
        try:
            return await fleet.read()
        finally:
            await fleet.aclose()

    return asyncio.run(read())
