"""The agent's prefix operations across its pools: which pool a command is for, and the previews
of the prefixes the wire models show (`api_views`).

Every command runs on the engine thread (`AgentService.call`), between two steps, and refuses
any other caller while that thread runs (`engine_only`, against the service's owner). A pool runs
them through its engine's `PrefixOperations`; a pool without a prefix cache refuses them in one
line. Pin ids are unique across the pools, so unpinning needs no model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvctl import api
from kvctl.agent.api_views import cached_prefix_view, lookup_view, pin_view
from kvctl.agent.model_pool import ModelPool
from kvctl.agent.prefix.prefix_cache import CachedPrefix
from kvctl.agent.runtime.prefix_ops import PrefixOperations
from kvctl.agent.runtime.prefix_pins import PrefixOpRefused as PrefixOpRefused
from kvctl.agent.runtime.prefix_pins import PrefixPin
from kvctl.agent.runtime.prefix_pins import UnknownPin as UnknownPin
from kvctl.agent.runtime.thread_owner import ThreadOwner, engine_only

LISTED_PREFIXES = 10
PREVIEW_TOKENS = 48


class UnknownSalt(LookupError):
    """A clear named a cache salt nothing is cached or pinned under."""


class PrefixAdmin:
    """Lookups, pins and clears on the pools of one agent (engine thread)."""

    def __init__(
        self,
        pools: dict[str, ModelPool],
        pool: Callable[[str | None], ModelPool],
        owner: ThreadOwner,
    ) -> None:
        self.pools = pools
        self._pool = pool  # the pool a command names (`AgentService.pool`)
        self.owner = owner  # the engine thread's (`AgentService.owner`)

    def ops(self, name: str | None) -> tuple[ModelPool, PrefixOperations]:
        """The pool named and its prefix operations; `PrefixOpRefused` without a cache."""
        pool = self._pool(name)
        ops = pool.engine.prefix_ops
        if ops is None:
            raise PrefixOpRefused(
                f"model {pool.name} runs without a prefix cache (--no-prefix-cache): nothing "
                "is cached to look up, pin or clear"
            )
        return pool, ops

    @engine_only
    def lookup(
        self, name: str | None, salt: str | None, token_ids: Sequence[int]
    ) -> api.PrefixLookupResult:
        pool, ops = self.ops(name)
        return lookup_view(pool.name, ops.lookup(salt, token_ids))

    @engine_only
    def pin(
        self, name: str | None, salt: str | None, token_ids: Sequence[int], ttl_s: float | None
    ) -> api.PrefixPinView:
        pool, ops = self.ops(name)
        return _pin_view(pool, ops.pin(salt, token_ids, ttl_s))

    @engine_only
    def store_below(
        self, name: str | None, salt: str | None, token_ids: Sequence[int], tier: str
    ) -> int:
        _, ops = self.ops(name)
        return ops.store_below(salt, token_ids, tier)

    @engine_only
    def unpin(self, pin_id: str) -> api.PrefixPinView:
        for pool in self.pools.values():
            ops = pool.engine.prefix_ops
            if ops is not None and any(p.pin_id == pin_id for p in ops.pins.all()):
                return _pin_view(pool, ops.unpin(pin_id))
        raise UnknownPin(f"no pin {pin_id!r} (kvctl prefix ls lists them)")

    def expire(self) -> None:
        """End the pins whose time has come, in every pool."""
        for pool in self.pools.values():
            if pool.engine.prefix_ops is not None:
                pool.engine.prefix_ops.expire()

    @engine_only
    def listing(self, name: str | None, count: int = LISTED_PREFIXES) -> api.PrefixListing:
        """The pins and the `count` largest cached prefixes of one pool, or of every pool."""
        pools = list(self.pools.values()) if name is None else [self._pool(name)]
        pins: list[api.PrefixPinView] = []
        prefixes: list[api.CachedPrefixView] = []
        pinned = cap = capacity = 0
        for pool in pools:
            ops = pool.engine.prefix_ops
            capacity += pool.engine.pool.capacity
            if ops is None:
                continue
            pins += [_pin_view(pool, pin) for pin in ops.pins.all()]
            prefixes += [_prefix_view(pool, p) for p in ops.cache.largest(count)]
            pinned += ops.pins.pinned_pages
            cap += ops.cap_pages
        prefixes.sort(key=lambda p: -p.tokens)
        return api.PrefixListing(
            pins=pins,
            prefixes=prefixes[:count],
            pinned_pages=pinned,
            pin_cap_pages=cap,
            capacity_pages=capacity,
        )

    @engine_only
    def clear(self, name: str | None, salt: str | None, place: str) -> api.PrefixClearResult:
        """Forget cached prefixes of one model (every model when `name` is None), one salt
        (every salt when None), in one place or all; `UnknownSalt` when no pool has anything
        under `salt`, before anything changes."""
        pools = list(self.pools.values()) if name is None else [self._pool(name)]
        targets = [(pool, ops) for pool in pools if (ops := pool.engine.prefix_ops) is not None]
        if not targets:
            raise PrefixOpRefused("no model here runs with a prefix cache: nothing to clear")
        salts = None if salt is None else {salt}
        if salt is not None and not any(ops.knows_salt(salt) for _, ops in targets):
            raise UnknownSalt(
                f"nothing is cached or pinned under cache salt {salt!r} on "
                f"{'model ' + name if name else 'any model'}; nothing was cleared"
            )
        freed: dict[str, int] = {}
        removed: list[str] = []
        in_use = 0
        if place != "all":
            for _, ops in targets:
                ops.check_places({place})
        for _, ops in targets:
            places = ops.places() if place == "all" else {place}
            report = ops.clear(salts, places)
            for where, pages in report.pages_freed.items():
                freed[where] = freed.get(where, 0) + pages
            removed += [p.pin_id for p in report.pins_removed]
            in_use += report.pages_in_use
        return api.PrefixClearResult(
            models=[pool.name for pool, _ in targets],
            pages_freed=freed,
            pins_removed=removed,
            pages_in_use=in_use,
        )


def _preview(pool: ModelPool, token_ids: Sequence[int]) -> str:
    tokenizer = pool.engine.tokenizer
    ids = list(token_ids[:PREVIEW_TOKENS])
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids)


def _pin_view(pool: ModelPool, pin: PrefixPin) -> api.PrefixPinView:
    return pin_view(pool.name, pin, _preview(pool, pin.token_ids))


def _prefix_view(pool: ModelPool, prefix: CachedPrefix) -> api.CachedPrefixView:
    return cached_prefix_view(pool.name, prefix, _preview(pool, prefix.tokens))
