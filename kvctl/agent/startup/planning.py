"""How the agent sizes its pools at start-up: models, flags and the KV budget in, a plan out.

Pure: it reads the configuration and, for each loaded model, its name, its `[[models]]` limits
and the bytes of one page (`ModelPages`), never the model itself, and imports no torch, so a plan
can be tested alone. kvctl.agent.startup.wiring builds the pools it describes. Every refusal is a
`ConfigError` whose one line names the flag to change.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvctl.agent.config import (
    CEILING_FACTOR,
    DEFAULT_POOL_PAGES,
    DEFAULT_SEGMENTS,
    AgentConfig,
    ConfigError,
    ModelSpec,
)
from kvctl.settings import StartupLimits
from kvctl.sizing import PoolFit
from kvctl.units import format_bytes

log = logging.getLogger("kvctl.agent")
DEMO_SHAPE = (4, 4)  # layers, KV heads of `--model demo`


def whole_segments(pages: int, segment: int) -> int:
    """`pages` rounded up to whole segments, as the engine allocates a pool."""
    return -(-pages // segment) * segment


@dataclass(frozen=True)
class ModelPages:
    """What the plan needs of one loaded model: its name, its `[[models]]` (or `--model`)
    entry with the pool's own limits, and the bytes of one page of its KV cache."""

    name: str
    spec: ModelSpec
    bytes_per_page: int


@dataclass(frozen=True)
class PoolSize:
    """How one pool is sized at start: its own keys, else the top-level flags."""

    pool_pages: int | None = None
    pool_memory: int | None = None
    gpu_memory_fraction: float | None = None


@dataclass(frozen=True)
class TierShare:
    """One model's tiers: all of `--host-tier-memory` and `--disk-tier-size` for a lone model;
    with several, an equal share of each and a directory of its own under `--disk-tier-path`
    (each disk tier removes the stale page files of its directory at start, so no two share
    one)."""

    host_bytes: int
    disk_path: str | None
    disk_bytes: int

    @classmethod
    def whole(cls, config: AgentConfig) -> TierShare:
        path = str(config.disk_tier_path) if config.disk_tier_path else None
        return cls(config.host_tier_memory, path, config.disk_tier_bytes)

    @classmethod
    def of(cls, config: AgentConfig, name: str, models: int) -> TierShare:
        if models == 1:
            return cls.whole(config)
        path = config.disk_tier_path
        return cls(
            config.host_tier_memory // models,
            str(path / tier_directory(name)) if path is not None else None,
            config.disk_tier_bytes // models,
        )


def tier_directory(name: str) -> str:
    """A model's directory under `--disk-tier-path`: its name with anything but letters,
    digits, `.`, `_` and `-` replaced, never `.`, `..` or hidden."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return f"_{safe}" if safe.startswith(".") else safe


@dataclass(frozen=True)
class PoolPlan:
    """One pool's start-up size, segment, floor and ceiling, in pages, and its tiers."""

    pages: int
    segment: int
    floor: int
    ceiling: int
    tiers: TierShare

    @property
    def capacity(self) -> int:
        """The start size in whole segments, as the engine allocates it."""
        return whole_segments(self.pages, self.segment)

    @property
    def limits(self) -> StartupLimits:
        """What no runtime setting of this pool may exceed."""
        return StartupLimits(self.segment, max(self.ceiling, self.segment))


@dataclass(frozen=True)
class Plan:
    """Every pool's plan, in the order of the models, and the KV budget they share (None for a
    lone model: `--kv-budget` is then its ceiling, and its size unless one is given)."""

    pools: list[PoolPlan]
    budget_bytes: int | None


def demo_shape(path: str) -> tuple[int, int] | None:
    """(layers, KV heads) of `demo[:LAYERSxKV_HEADS]`, None for any other path. Several demo
    models of different shapes on one agent have pages of different sizes, like real ones."""
    if path == "demo":
        return DEMO_SHAPE
    if not path.startswith("demo:"):
        return None
    layers, sep, heads = path.removeprefix("demo:").partition("x")
    if not (sep and layers.isdigit() and heads.isdigit()):
        raise ConfigError(f"--model {path}: write demo:LAYERSxKV_HEADS, e.g. demo:8x2")
    shape = int(layers), int(heads)
    if not 1 <= shape[0] <= 64 or shape[1] not in (1, 2, 4, 8):
        raise ConfigError(f"--model {path}: 1 to 64 layers and 1, 2, 4 or 8 KV heads")
    return shape


def check_names(config: AgentConfig, names: Sequence[str]) -> None:
    """Refuse two models of one name, or two that would share a disk-tier directory."""
    if len(set(names)) != len(names):
        raise ConfigError(
            f"two models are named the same ({', '.join(names)}); name each one: --model NAME=PATH"
        )
    directories = [tier_directory(name) for name in names]
    if config.disk_tier_path is not None and len(set(directories)) != len(directories):
        raise ConfigError(
            f"two models would share a directory under --disk-tier-path ({', '.join(names)}); "
            "give them names that differ in letters, digits, '.', '_' or '-'"
        )


def pool_pages(
    size: PoolSize, bytes_per_page: int, free_device_bytes: int | None, flag: str = "--pool-memory"
) -> int:
    """Initial pool size in pages from --pool-pages, --pool-memory or --gpu-memory-fraction."""
    if size.pool_pages:
        return size.pool_pages
    if size.pool_memory:
        pages = size.pool_memory // bytes_per_page
        if pages < 1:
            raise ConfigError(
                f"{flag} {size.pool_memory} bytes is less than one page "
                f"({bytes_per_page} bytes); give a larger size"
            )
        return pages
    if size.gpu_memory_fraction:
        if free_device_bytes is None:
            raise ConfigError(
                "--gpu-memory-fraction: no GPU memory reading (NVML); use --pool-memory"
            )
        return max(1, int(free_device_bytes * size.gpu_memory_fraction) // bytes_per_page)
    return DEFAULT_POOL_PAGES


def plan_pools(
    config: AgentConfig, models: Sequence[ModelPages], free_device_bytes: int | None
) -> Plan:
    """Every pool's plan, and the budget they share (None for one model)."""
    if len(models) == 1:
        return Plan([_plan_alone(config, models[0], free_device_bytes)], None)
    budget = _shared_budget(config, free_device_bytes)
    share = None if budget is None else budget // len(models)
    sized = [_start_size(config, loaded, share) for loaded in models]
    total = sum(cap * m.bytes_per_page for (_, cap), m in zip(sized, models, strict=True))
    budget = total if budget is None else budget
    if total > budget:
        raise ConfigError(
            f"the pools' sizes add up to {format_bytes(total)}, over the KV budget of "
            f"{format_bytes(budget)}; give smaller pools or a larger --kv-budget"
        )
    floors = [
        whole_segments(m.spec.min_pool_pages or segment, segment)
        for (segment, _), m in zip(sized, models, strict=True)
    ]
    kept = sum(f * m.bytes_per_page for f, m in zip(floors, models, strict=True))
    plans = []
    for (segment, capacity), loaded, floor in zip(sized, models, floors, strict=True):
        room = budget - kept + floor * loaded.bytes_per_page  # the others at their floors
        whole = room // loaded.bytes_per_page // segment * segment
        ceiling = loaded.spec.max_pool_pages or config.max_pool_pages or whole
        if not floor <= capacity <= ceiling:
            raise ConfigError(
                f"model {loaded.name}: its pool of {capacity} pages is outside its floor "
                f"{floor} and ceiling {ceiling} (min_pool_pages, max_pool_pages)"
            )
        tiers = TierShare.of(config, loaded.name, len(models))
        plans.append(PoolPlan(capacity, segment, floor, ceiling, tiers))
    return Plan(plans, budget)


def _shared_budget(config: AgentConfig, free_device_bytes: int | None) -> int | None:
    """Bytes several pools share: `--kv-budget`, else `--gpu-memory-fraction` of free memory,
    else None (the sum of their sizes)."""
    if config.kv_budget is not None or not config.gpu_memory_fraction:
        return config.kv_budget
    if free_device_bytes is None:
        raise ConfigError("--gpu-memory-fraction: no GPU memory reading (NVML); use --kv-budget")
    return int(free_device_bytes * config.gpu_memory_fraction)


def _size_of(spec: ModelSpec, config: AgentConfig) -> PoolSize:
    if spec.pool_pages or spec.pool_memory:
        return PoolSize(spec.pool_pages, spec.pool_memory)
    return PoolSize(config.pool_pages, config.pool_memory, config.gpu_memory_fraction)


def _segment(spec: ModelSpec, config: AgentConfig, pages: int) -> int:
    """Pages per segment: the model's, the flag's, else an eighth of the starting pool."""
    return spec.segment_pages or config.segment_pages or max(1, -(-pages // DEFAULT_SEGMENTS))


def _start_size(config: AgentConfig, loaded: ModelPages, share: int | None) -> tuple[int, int]:
    """(segment, capacity) of a pool that shares a budget: the size given for it rounded up to
    whole segments (as the engine does), else `share` bytes rounded down, so that equal shares
    always fit the budget."""
    size, per_page = _size_of(loaded.spec, config), loaded.bytes_per_page
    if size.pool_pages or size.pool_memory or share is None:
        pages = pool_pages(size, per_page, None, f"model {loaded.name}: pool_memory")
        segment = _segment(loaded.spec, config, pages)
        return segment, whole_segments(pages, segment)
    pages = share // per_page
    if pages < 1:
        raise ConfigError(
            f"the KV budget's share of each model, {format_bytes(share)}, is less than one page "
            f"of {loaded.name} ({format_bytes(per_page)}); give a larger --kv-budget"
        )
    segment = _segment(loaded.spec, config, pages)
    return segment, pages // segment * segment


def _plan_alone(config: AgentConfig, loaded: ModelPages, free: int | None) -> PoolPlan:
    spec, per_page = loaded.spec, loaded.bytes_per_page
    size = _size_of(spec, config)
    if config.kv_budget and not (size.pool_pages or size.pool_memory):
        size = PoolSize(pool_memory=config.kv_budget)
    pages = pool_pages(size, per_page, free)
    segment = _segment(spec, config, pages)
    ceiling = spec.max_pool_pages or config.max_pool_pages
    if ceiling is None and config.kv_budget:
        ceiling = max(segment, config.kv_budget // per_page // segment * segment)
    if ceiling and pages > ceiling:
        raise ConfigError(
            f"the pool's initial size of {pages} pages is above --max-pool-pages "
            f"{ceiling}; give a smaller size or a larger limit"
        )
    return PoolPlan(
        pages,
        segment,
        spec.min_pool_pages or segment,
        ceiling or max(CEILING_FACTOR * pages, segment),
        TierShare.whole(config),
    )


def log_pool_size(fit: PoolFit) -> None:
    """One line saying what the pool holds, and a warning when it cannot hold the model's
    context: requests longer than the pool are refused, which the operator should learn now
    rather than from a client's 400."""
    whole = f"{fit.pages:,} pages of {fit.page_size} tokens"
    limit = "the model's context" if fit.largest_request == fit.context else "the pool"
    log.info(
        "pool: %s, %s each (%s): %s tokens; largest request %s tokens (prompt + max_tokens, %s)",
        whole,
        format_bytes(fit.bytes_per_page),
        format_bytes(fit.pages * fit.bytes_per_page),
        f"{fit.tokens:,}",
        f"{fit.largest_request:,}",
        limit,
    )
    if fit.short_of_context and fit.context is not None:
        pages = fit.pages_for(fit.context)
        mib = -(-pages * fit.bytes_per_page // (1 << 20))
        log.warning(
            "the pool holds %s tokens, fewer than the model's context of %s: longer requests "
            "are refused; start with --pool-pages %d or --pool-memory %dMiB to hold one full "
            "context",
            f"{fit.tokens:,}",
            f"{fit.context:,}",
            pages,
            mib,
        )
