"""One reading of each agent in a fleet: health, pools, alerts (and a page map on request).

`kvctl status`, `kvctl top --once/--headless` and the TUI all show the same `Reading`, so a
number means the same thing on every screen. Agents are read concurrently: one agent that hangs
costs the fleet one timeout, not one timeout per agent. A reading that failed keeps the error,
so an unreachable agent is a row in the fleet table rather than an exception.

An agent serving several models has a pool for each; its reading holds them all and shows one
(`pool`), and `per_pool()` splits it into one reading per pool, which is how the fleet views get
one row per agent and pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvctl.api import Alert, Health, PoolMap, PoolSnapshot
from kvctl.client import (
    DEFAULT_TIMEOUT,
    AgentError,
    AgentNeedsPool,
    AgentNoSuchPool,
    AgentProtocolError,
    AgentRouteMissing,
    AsyncAgentClient,
)


@dataclass(frozen=True)
class Reading:
    """What one agent said at one moment, or why it said nothing."""

    agent: str
    health: Health | None = None
    pool: PoolSnapshot | None = None
    alerts: tuple[Alert, ...] = ()
    map: PoolMap | None = None
    error: AgentError | None = None
    pools: tuple[PoolSnapshot, ...] = ()
    """Every pool of the agent, in the order its models were configured; `pool` is the one
    shown (the only one, or the one asked for)."""
    budget_bytes: int | None = None
    """The memory budget the pools share (null without one)."""
    assigned_bytes: int | None = None
    """Bytes the pools hold together, within `budget_bytes`."""

    @property
    def up(self) -> bool:
        return self.error is None and self.pool is not None

    @property
    def several(self) -> bool:
        """The agent serves several models, so a pool must be named to act on one."""
        return len(self.pools) > 1

    @property
    def every_pool(self) -> tuple[PoolSnapshot, ...]:
        if self.pools:
            return self.pools
        return () if self.pool is None else (self.pool,)

    def for_pool(self, name: str | None) -> Reading:
        """The reading as pool `name` shows it: that pool, its alerts (and those of no pool),
        and the map if it is of that pool. Itself for an agent with one pool; the shown pool
        for a name the agent does not serve."""
        if not self.several:
            return self
        pool = next((p for p in self.pools if p.pool == name), self.pool)
        assert pool is not None
        alerts = tuple(a for a in self.alerts if a.labels.get("pool", pool.pool) == pool.pool)
        page_map = self.map if map_of(self.map, pool.pool) else None
        return replace(self, pool=pool, alerts=alerts, map=page_map)

    def per_pool(self) -> list[Reading]:
        """One reading per pool (the fleet views' rows); itself when the agent has one pool or
        did not answer."""
        if not self.several or not self.up:
            return [self]
        return [self.for_pool(pool.pool) for pool in self.pools]

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


def json_entries(readings: Sequence[Reading]) -> list[dict[str, Any]]:
    """`kvctl status --json`'s entries: one per agent and pool, each of the same shape."""
    return [row.to_json() for reading in readings for row in reading.per_pool()]


def _dump(model: Any) -> Any:
    return None if model is None else model.model_dump(mode="json")


def map_of(page_map: PoolMap | None, pool: str) -> bool:
    """Whether `page_map` is the map of pool `pool` (one from an older agent names none, and is
    of its only pool)."""
    return page_map is not None and (page_map.pool is None or page_map.pool.pool == pool)


async def read_agent(
    client: AsyncAgentClient, with_map: bool = False, pool: str | None = None
) -> Reading:
    """Health, pools and alerts of one agent, read concurrently, showing pool `pool` (None or
    a pool it does not serve: its first); with `with_map`, the page map of that pool too."""
    calls = [client.health(), client.pools(), client.alerts()]
    if with_map:
        calls.append(_page_map(client, pool))
    try:
        health, listing, alerts, *rest = await asyncio.gather(*calls)
        pools = list(listing.pools)
        if not pools:
            raise AgentProtocolError(client.url, f"agent {client.url}: it lists no pool")
        shown = next((p for p in pools if p.pool == pool), pools[0])
        page_map = rest[0] if rest else None
        if with_map and not map_of(page_map, shown.pool):  # its pools were not known yet
            page_map = await client.pool_map(shown.pool if len(pools) > 1 else None)
    except AgentError as error:
        return Reading(agent=client.url, error=error)
    if page_map is not None and page_map.pool is not None:
        shown = page_map.pool  # one moment for the numbers and the map
        pools = [shown if p.pool == shown.pool else p for p in pools]
    return Reading(
        agent=client.url,
        health=health,
        pool=shown,
        alerts=tuple(alerts.alerts),
        map=page_map,
        pools=tuple(pools),
        budget_bytes=listing.budget_bytes,
        assigned_bytes=listing.assigned_bytes,
    )


async def _page_map(client: AsyncAgentClient, pool: str | None) -> PoolMap | None:
    """The map of `pool` (None: the only pool); None where the agent serves several models and
    none, or one it does not serve, was named (or it is too old for named pools), for
    `read_agent` to read once it knows its pools."""
    try:
        return await client.pool_map(pool)
    except (AgentNeedsPool, AgentNoSuchPool, AgentRouteMissing):
        return None


async def read_fleet(
    clients: Sequence[AsyncAgentClient],
    with_map: bool = False,
    pools: Mapping[str, str] | None = None,
) -> list[Reading]:
    """One reading per client, in the order given; `pools` names the pool to show (and map)
    by agent URL."""
    shown = pools or {}
    return list(await asyncio.gather(*(read_agent(c, with_map, shown.get(c.url)) for c in clients)))


@dataclass
class Fleet:
    """Async clients for a list of agent URLs, opened once and reused between polls."""

    urls: Sequence[str]
    token: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    clients: list[AsyncAgentClient] = field(init=False)

    def __post_init__(self) -> None:
        self.clients = [AsyncAgentClient(url, self.token, self.timeout) for url in self.urls]

    async def read(
        self, with_map: bool = False, pools: Mapping[str, str] | None = None
    ) -> list[Reading]:
        return await read_fleet(self.clients, with_map, pools)

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
