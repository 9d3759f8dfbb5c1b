"""One reading of each agent in a fleet: health, pools, alerts (and a page map on request).

`kvctl status`, `kvctl top --once/--headless` and the TUI all show the same `Reading`, so a
number means the same thing on every screen. Agents are read concurrently: one agent that hangs
costs the fleet one timeout, not one timeout per agent. A reading that failed keeps the error,
so an unreachable agent is a row in the fleet table rather than an exception; so is a node
whose answer could not be made into figures (`read_fleet` isolates each node).

An agent serving several models has a pool for each; its reading holds them all and shows one
(`pool`), and `per_pool()` splits it into one reading per pool, which is how the fleet views get
one row per agent and pool.

An inference engine (vLLM, SGLang, TensorRT-LLM) is read from its /metrics: named in the URL
(`vllm+http://node:8000`) or recognised there when a URL answers but not as a kvctl agent. Its
reading has `figures` (what the engine exports, "–" for the rest) and no pool; a model it
serves is a row, as a pool is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
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
    NotAnAgent,
    normalize_url,
)
from kvctl.engines import BY_NAME, ENGINES, KVCTL, METRICS_PATHS, split_engine
from kvctl.exposition import ExpositionError, ModelFigures, between, detect, engine_rows
from kvctl.figures import Figures, pool_figures


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
    engine: str = KVCTL
    """What answered: "kvctl", or the engine (`kvctl.engines`) whose /metrics was read."""
    figures: Figures | None = None
    """The row's figures where there is no pool to take them from (an engine, or a node read
    from Prometheus)."""
    models: tuple[ModelFigures, ...] = ()
    """Every model of an engine; `model` is the one shown."""
    model: str | None = None
    source: str = "agent"
    """Where the figures come from: "agent" (its API), "metrics" (its /metrics), or
    "prometheus"."""
    notes: tuple[str, ...] = ()
    """What the figures do not say (an engine's pitfalls), for the row's detail."""

    @property
    def up(self) -> bool:
        return self.error is None and (self.pool is not None or self.figures is not None)

    @property
    def several(self) -> bool:
        """The node serves several models, so a pool must be named to act on one (for an
        engine: a row each)."""
        return len(self.pools) > 1 or len(self.models) > 1

    @property
    def row_figures(self) -> Figures | None:
        """The figures its row shows: the shown pool's, or those its source exported."""
        if self.figures is not None:
            return self.figures
        return None if self.pool is None else pool_figures(self.pool)

    @property
    def row_name(self) -> str | None:
        """The pool (or the engine's model) the row is of."""
        return self.pool.pool if self.pool is not None else self.model

    @property
    def alerts_read(self) -> bool:
        """Whether `alerts` were read at all: an engine's /metrics says nothing of alerts, so
        its rows show "–", not "none"."""
        return self.source != "metrics"

    @property
    def acts(self) -> bool:
        """Whether its agent's API was read, so defrag and resize can be sent to it."""
        return self.engine == KVCTL and self.source == "agent" and self.pool is not None

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
        if self.models:
            row = next((m for m in self.models if m.model == name), self.models[0])
            label = "pool" if self.engine == KVCTL else BY_NAME[self.engine].model_label
            alerts = tuple(
                a for a in self.alerts if a.labels.get(label or "", row.model) in ("", row.model)
            )
            return replace(self, model=row.model, figures=row.figures, alerts=alerts)
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
        if self.models:
            return [self.for_pool(row.model) for row in self.models]
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
            "engine": self.engine,
            "source": self.source,
            "health": _dump(self.health),
            "pool": _dump(self.pool),
            "model": self.row_name,
            "figures": None if self.row_figures is None else asdict(self.row_figures),
            "alerts": [alert.model_dump(mode="json") for alert in self.alerts],
            "notes": list(self.notes),
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
    try:
        health, listing, alerts, page_map = await settled(
            client.health(),
            client.pools(),
            client.alerts(),
            _page_map(client, pool) if with_map else _nothing(),
        )
        pools = list(listing.pools)
        if not pools:
            raise AgentProtocolError(client.url, f"agent {client.url}: it lists no pool")
        shown = next((p for p in pools if p.pool == pool), pools[0])
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


async def settled(*calls: Awaitable[Any]) -> list[Any]:
    """Every call's answer, or the first call's error once all have finished: a plain
    gather returns at the first error and leaves the other requests running into the next
    poll."""
    answers = await asyncio.gather(*calls, return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    return answers


async def _nothing() -> None:
    """The page map not asked for."""


async def _page_map(client: AsyncAgentClient, pool: str | None) -> PoolMap | None:
    """The map of `pool` (None: the only pool); None where the agent serves several models and
    none, or one it does not serve, was named (or it is too old for named pools), for
    `read_agent` to read once it knows its pools."""
    try:
        return await client.pool_map(pool)
    except (AgentNeedsPool, AgentNoSuchPool, AgentRouteMissing):
        return None


@dataclass(frozen=True)
class Node:
    """A URL to read, and what it is when `--agent` said so (`vllm+http://...`)."""

    url: str
    engine: str | None = None
    """None: a kvctl agent, else whatever engine its /metrics shows."""


def parse_node(text: str) -> Node:
    """`vllm+http://node:8000` as that URL read as vLLM; a plain URL as itself (ValueError,
    one line, for an engine kvctl does not know or a bad URL)."""
    engine, url = split_engine(text)
    return Node(normalize_url(url), engine)


async def read_node(
    client: AsyncAgentClient,
    engine: str | None = None,
    with_map: bool = False,
    pool: str | None = None,
    previous: Reading | None = None,
) -> Reading:
    """A kvctl agent through its API, an engine through its /metrics; a URL that answers but
    not as an agent is read as whichever engine its /metrics shows, if any. `previous` (the
    node's last reading) lets an engine's prefix ratio be taken between the two."""
    if engine not in (None, KVCTL):
        return await read_engine(client, engine, pool, previous)
    reading = await read_agent(client, with_map, pool)
    if engine is None and isinstance(reading.error, (NotAnAgent, AgentRouteMissing)):
        found = await read_engine(client, None, pool, previous)
        if found.error is None or not isinstance(found.error, NotAnAgent):
            return found
        known = ", ".join(e.title for e in ENGINES)
        message = f"{reading.error}; nor is it an engine kvctl reads ({known})"
        return replace(reading, error=NotAnAgent(client.url, message, reading.error.reason))
    return reading


async def read_engine(
    client: AsyncAgentClient,
    engine: str | None,
    model: str | None = None,
    previous: Reading | None = None,
) -> Reading:
    """An engine's figures from its exposition (`engine` None: whichever it shows, looked for
    where each engine serves it), showing model `model` (None or one it does not serve: its
    first)."""
    paths = METRICS_PATHS if engine is None else (BY_NAME[engine].metrics_path,)
    found: Reading | None = None
    for path in paths:
        found = await _read_exposition(client, engine, path, model, previous)
        if found.error is None or not isinstance(found.error, NotAnAgent):
            return found
    assert found is not None
    return found


async def _read_exposition(
    client: AsyncAgentClient,
    engine: str | None,
    path: str,
    model: str | None,
    previous: Reading | None,
) -> Reading:
    try:
        exposition = await client.exposition(path)
    except AgentError as error:
        return Reading(agent=client.url, engine=engine or KVCTL, error=error)
    except ExpositionError as error:
        what = NotAnAgent(client.url, f"{client.url}{path}: {error}", reason="no exposition")
        return Reading(agent=client.url, engine=engine or KVCTL, error=what)
    name = engine or detect(exposition)
    if name is None or name == KVCTL:
        said = "shows no known engine" if name is None else "is a kvctl agent's"
        unknown = NotAnAgent(client.url, f"{client.url}{path} {said}", reason="no known engine")
        return Reading(agent=client.url, error=unknown)
    spec = BY_NAME[name]
    if engine is not None and spec.marker not in exposition:
        message = f"{client.url}{path} has no {spec.marker}; is it {spec.title}?"
        other = NotAnAgent(client.url, message, reason=f"not {spec.title}")
        return Reading(agent=client.url, engine=name, error=other)
    before = {row.model: row for row in previous.models} if previous is not None else {}
    rows = [between(before.get(row.model), row) for row in engine_rows(spec, exposition)]
    shown = next((row for row in rows if row.model == model), rows[0])
    return Reading(
        agent=client.url,
        engine=name,
        figures=shown.figures,
        models=tuple(rows),
        model=shown.model or None,
        source="metrics",
        notes=spec.pitfalls + tuple(note for row in rows for note in row.notes),
    )


async def read_fleet(
    clients: Sequence[AsyncAgentClient],
    with_map: bool = False,
    pools: Mapping[str, str] | None = None,
    engines: Mapping[str, str | None] | None = None,
    previous: Mapping[str, Reading] | None = None,
) -> list[Reading]:
    """One reading per client, in the order given; `pools` names the pool (or model) to show
    and map by URL, `engines` what each URL is where `--agent` said so."""
    shown, kinds, last = pools or {}, engines or {}, previous or {}
    return list(
        await asyncio.gather(
            *(
                _isolated(c, kinds.get(c.url), with_map, shown.get(c.url), last.get(c.url))
                for c in clients
            )
        )
    )


async def _isolated(
    client: AsyncAgentClient,
    engine: str | None,
    with_map: bool,
    pool: str | None,
    previous: Reading | None,
) -> Reading:
    """`read_node`, with a failure to make its answer into figures kept as the node's error:
    one node's nonsense must not cost the other nodes their rows."""
    try:
        return await read_node(client, engine, with_map, pool, previous)
    except (ValueError, ArithmeticError, TypeError, RecursionError) as error:
        said = " ".join(str(error).split()) or type(error).__name__
        message = f"{client.url}: its answer could not be read ({said})"
        return Reading(agent=client.url, error=AgentProtocolError(client.url, message))


@dataclass
class Fleet:
    """Async clients for a list of nodes (`--agent` values), opened once and reused between
    polls; the last reading of each is kept, so an engine's ratios are taken between polls."""

    urls: Sequence[str]
    token: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    clients: list[AsyncAgentClient] = field(init=False)
    engines: dict[str, str | None] = field(init=False)
    last: dict[str, Reading] = field(init=False, default_factory=dict)
    found: set[str] = field(init=False, default_factory=set)
    """URLs whose engine a read found rather than `--agent` named."""

    def __post_init__(self) -> None:
        nodes = [parse_node(url) for url in self.urls]
        self.clients = [AsyncAgentClient(node.url, self.token, self.timeout) for node in nodes]
        self.engines = {node.url: node.engine for node in nodes}

    async def read(
        self, with_map: bool = False, pools: Mapping[str, str] | None = None
    ) -> list[Reading]:
        readings = await read_fleet(self.clients, with_map, pools, self.engines, self.last)
        self.last.update((r.agent, r) for r in readings if r.up)
        for reading in readings:  # found once, later polls read its exposition straight away
            url = reading.agent
            if reading.up and reading.engine != KVCTL and self.engines.get(url) is None:
                self.engines[url] = reading.engine
                self.found.add(url)
            elif url in self.found and isinstance(reading.error, NotAnAgent):
                self.engines[url] = None  # something else answers there now: look again
                self.found.discard(url)
        return readings

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self.clients))


def read_fleet_once(
    urls: Sequence[str], token: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> list[Reading]:
    """A blocking read of every node, for commands that print once and exit."""

    async def read() -> list[Reading]:
        fleet = Fleet(urls, token, timeout)
        try:
            return await fleet.read()
        finally:
            await fleet.aclose()

    return asyncio.run(read())
