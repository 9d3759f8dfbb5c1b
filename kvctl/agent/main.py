"""`kvctl-agent`: load the model, size the pool, serve the API until SIGTERM.

Start-up refuses bad configuration with one line on stderr and exit code 2 before anything is
allocated; once the socket listens it logs `listening on http://HOST:PORT` (tests and scripts
wait for that line), and SIGTERM lets running requests finish for `shutdown_grace` seconds,
aborts the rest and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import typer

from kvctl import __version__
from kvctl.agent.config import (
    CPU_PREFILL_WHILE_DECODING,
    DEFAULT_LONG_PROMPT_TOKENS,
    DEFAULT_MAX_BATCHED_TOKENS,
    DEFAULT_MAX_WAITING,
    AgentConfig,
    ConfigError,
    ModelSpec,
    load_config,
)
from kvctl.api import DEFAULT_PORT
from kvctl.settings import FLAGS, SettingsError, StartupLimits, apply_changes
from kvctl.sizing import PoolFit
from kvctl.units import format_bytes

log = logging.getLogger("kvctl.agent")
DEFAULT_POOL_PAGES = 1024
DEFAULT_SEGMENTS = 8
DEMO_SHAPE = (4, 4)  # layers, KV heads of `--model demo`

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def _flag_help(flag: str) -> str:
    """A runtime setting's flag help, from its one definition in kvctl.settings."""
    spec = FLAGS[flag]
    return f"{spec.help} Sets {spec.key} (default {spec.default})."


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


def default_torch_threads() -> int:
    """Every core the process may run on: decode is bound by memory bandwidth, which one core
    alone cannot draw. Monitoring stays fast beside it because its routes read the snapshot the
    engine publishes and hold the GIL for well under a scheduler slice (docs/performance.md,
    "Torch threads")."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class PoolSize:
    """How one pool is sized at start: its own keys, else the top-level flags."""

    pool_pages: int | None = None
    pool_memory: int | None = None
    gpu_memory_fraction: float | None = None


@dataclass(frozen=True)
class LoadedModel:
    """A model loaded for serving, with what its pool needs to know about it."""

    spec: ModelSpec
    name: str
    served_names: tuple[str, ...]
    model_config: Any
    model: Any
    tokenizer: Any
    template: Any
    bytes_per_page: int


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
    """One pool's start-up size, segment, floor and ceiling, in pages."""

    pages: int
    segment: int
    floor: int
    ceiling: int


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


def _load_model(spec: ModelSpec, config: AgentConfig) -> LoadedModel:
    import torch

    from kvctl.agent.model import CheckpointError, build_demo_model, load_checkpoint
    from kvctl.agent.model.chat_template import demo_chat_template
    from kvctl.agent.model.demo import demo_config
    from kvctl.agent.pool.storage import KVStorage

    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    shape = demo_shape(spec.path)
    try:
        if shape is not None:
            layers, heads = shape
            base = demo_config()
            shaped = dataclasses.replace(base, num_layers=layers, num_kv_heads=heads)
            mc, model, tokenizer = build_demo_model(
                config.device, dtype or torch.float32, config=shaped
            )
            template = demo_chat_template()
        else:
            mc, model, tokenizer = load_checkpoint(Path(spec.path), config.device, dtype)
            template = mc.chat_template
    except CheckpointError as error:
        raise ConfigError(f"--model {spec.path}: {error}") from None
    name = spec.name or mc.name or Path(spec.path).name
    names = list(spec.served_model_name)
    if spec.name and spec.name not in names:
        names.insert(0, spec.name)
    page_bytes = KVStorage.page_bytes(
        config.page_size,
        mc.num_layers,
        mc.num_kv_heads,
        mc.head_dim,
        next(model.parameters()).dtype,
    )
    return LoadedModel(
        spec, name, tuple(names) or (name,), mc, model, tokenizer, template, page_bytes
    )


def _size_of(spec: ModelSpec, config: AgentConfig) -> PoolSize:
    if spec.pool_pages or spec.pool_memory:
        return PoolSize(spec.pool_pages, spec.pool_memory)
    return PoolSize(config.pool_pages, config.pool_memory, config.gpu_memory_fraction)


def plan_pools(
    config: AgentConfig, models: list[LoadedModel], free_device_bytes: int | None
) -> tuple[list[PoolPlan], int | None]:
    """Every pool's plan, and the budget they share (None for one model: `--kv-budget` is
    then its ceiling, and its size unless one is given)."""
    if len(models) == 1:
        return [_plan_alone(config, models[0], free_device_bytes)], None
    budget = config.kv_budget
    if budget is None and config.gpu_memory_fraction:
        if free_device_bytes is None:
            raise ConfigError(
                "--gpu-memory-fraction: no GPU memory reading (NVML); use --kv-budget"
            )
        budget = int(free_device_bytes * config.gpu_memory_fraction)
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
        -(-(m.spec.min_pool_pages or segment) // segment) * segment
        for (segment, _), m in zip(sized, models, strict=True)
    ]
    kept = sum(f * m.bytes_per_page for f, m in zip(floors, models, strict=True))
    plans = []
    for (segment, capacity), loaded, floor in zip(sized, models, floors, strict=True):
        spec = loaded.spec
        room = budget - kept + floor * loaded.bytes_per_page  # the others at their floors
        whole = room // loaded.bytes_per_page // segment * segment
        ceiling = spec.max_pool_pages or config.max_pool_pages or whole
        if not floor <= capacity <= ceiling:
            raise ConfigError(
                f"model {loaded.name}: its pool of {capacity} pages is outside its floor "
                f"{floor} and ceiling {ceiling} (min_pool_pages, max_pool_pages)"
            )
        plans.append(PoolPlan(capacity, segment, floor, ceiling))
    return plans, budget


def _segment(spec: ModelSpec, config: AgentConfig, pages: int) -> int:
    """Pages per segment: the model's, the flag's, else an eighth of the starting pool."""
    return spec.segment_pages or config.segment_pages or max(1, -(-pages // DEFAULT_SEGMENTS))


def _start_size(config: AgentConfig, loaded: LoadedModel, share: int | None) -> tuple[int, int]:
    """(segment, capacity) of a pool that shares a budget: the size given for it rounded up to
    whole segments (as the engine does), else `share` bytes rounded down, so that equal shares
    always fit the budget."""
    size, per_page = _size_of(loaded.spec, config), loaded.bytes_per_page
    if size.pool_pages or size.pool_memory or share is None:
        pages = pool_pages(size, per_page, None, f"model {loaded.name}: pool_memory")
        segment = _segment(loaded.spec, config, pages)
        return segment, -(-pages // segment) * segment
    pages = share // per_page
    if pages < 1:
        raise ConfigError(
            f"the KV budget's share of each model, {format_bytes(share)}, is less than one page "
            f"of {loaded.name} ({format_bytes(per_page)}); give a larger --kv-budget"
        )
    segment = _segment(loaded.spec, config, pages)
    return segment, pages // segment * segment


def _plan_alone(config: AgentConfig, loaded: LoadedModel, free: int | None) -> PoolPlan:
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
        pages, segment, spec.min_pool_pages or segment, ceiling or max(4 * pages, segment)
    )


def build_service(config: AgentConfig) -> Any:
    """Models, pools, engines and the service, as the configuration says (imports torch)."""
    import torch

    from kvctl.agent.budget import BudgetError, KvBudget
    from kvctl.agent.gpu import GpuProbe
    from kvctl.agent.model_pool import ModelPool
    from kvctl.agent.served import ServedModel
    from kvctl.agent.service import AgentService

    torch.manual_seed(config.seed)
    torch.set_num_threads(config.torch_threads or default_torch_threads())
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"--device {config.device}: torch sees no CUDA device here; use --device cpu"
        )
    models = [_load_model(spec, config) for spec in config.model_specs()]
    names = [m.name for m in models]
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
    gpu = GpuProbe()
    device_index = torch.device(config.device).index or 0
    free = gpu.free_bytes(device_index) if config.device.startswith("cuda") else None
    plans, budget_bytes = plan_pools(config, models, free)
    pools: list[ModelPool] = []
    settings = defaults = limits = None
    for loaded, plan in zip(models, plans, strict=True):
        mc = loaded.model_config
        capacity = -(-plan.pages // plan.segment) * plan.segment
        if len(models) > 1:
            log.info("model %s:", loaded.name)
        log_pool_size(
            PoolFit(config.page_size, loaded.bytes_per_page, capacity, mc.max_context_len)
        )
        pool_limits = StartupLimits(plan.segment, max(plan.ceiling, plan.segment))
        if settings is None:  # the settings are checked against the first pool's limits
            limits, defaults = pool_limits, pool_limits.defaults()
            try:
                settings = apply_changes(defaults, config.settings, defaults, limits)
            except SettingsError as error:
                raise ConfigError(str(error)) from None
        try:
            engine = _engine(
                loaded.model,
                loaded.tokenizer,
                config,
                plan.pages,
                plan.segment,
                pool_limits,
                settings,
                TierShare.of(config, loaded.name, len(models)),
            )
        except ValueError as error:  # a tier the host cannot give (memory, directory)
            raise ConfigError(str(error)) from None
        served = ServedModel(loaded.served_names, loaded.template, mc.max_context_len)
        pools.append(
            ModelPool(
                engine,
                loaded.name,
                pool_limits,
                served,
                window=config.stats_window,
                max_waiting=config.max_waiting,
            )
        )
    service = AgentService(pools, settings, gpu=gpu, defaults=defaults, limits=limits)
    if budget_bytes is not None:
        budget = KvBudget(budget_bytes)
        for pool, plan in zip(service.pools.values(), plans, strict=True):
            resizer = pool.engine.resizer
            resizer.min_pages, resizer.max_pages = plan.floor, plan.ceiling
            try:
                budget.add(pool.name, resizer)
            except BudgetError as error:
                raise ConfigError(str(error)) from None
        service.share_budget(budget)
        log.info(
            "KV budget %s shared by %d pools: %s assigned, %s unassigned",
            format_bytes(budget_bytes),
            len(plans),
            format_bytes(budget.assigned_bytes),
            format_bytes(budget.unassigned_bytes),
        )
    return service


def _engine(
    model: Any,
    tokenizer: Any,
    config: AgentConfig,
    pages: int,
    segment: int,
    limits: StartupLimits,
    settings: Any,
    tiers: TierShare | None = None,
) -> Any:
    """The engine the flags describe (its pool, prefix cache and tiers)."""
    from kvctl.agent.runtime import Engine, EngineConfig

    tiers = tiers or TierShare.whole(config)

    return Engine(
        model,
        tokenizer,
        EngineConfig(
            device=config.device,
            page_size=config.page_size,
            pool_pages=pages,
            segment_pages=segment,
            max_pool_pages=limits.max_pool_pages,
            max_batch_seqs=config.max_batch_seqs,
            max_batched_tokens=config.max_batched_tokens,
            long_prompt_tokens=config.long_prompt_tokens,
            max_prefill_while_decoding=config.max_prefill_while_decoding,
            defrag=settings.defrag,
            prefix_cache=config.prefix_cache,
            eviction_policy=settings.prefix_cache.eviction_policy,
            prefix_isolation=config.prefix_isolation,
            decode_read_path=config.decode_read_path,
            host_tier_bytes=tiers.host_bytes,
            host_tier_policy=settings.prefix_cache.host_tier_policy,
            disk_tier_path=tiers.disk_path,
            disk_tier_bytes=tiers.disk_bytes,
            disk_tier_policy=settings.prefix_cache.disk_tier_policy,
        ),
    )


def _secret(path: Path | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text().strip()
    except OSError as error:
        raise ConfigError(f"cannot read {flag} {path}: {error.strerror}") from None


def alert_loop(service: Any, config: AgentConfig, advertised: str) -> Any:
    """The alert evaluator, and the Alertmanager notifier when `--alertmanager-url` is set.

    `advertised` is the agent's URL as others reach it: its authority (`host:port`, what
    Prometheus attaches as `instance` when it scrapes that address) is the `instance` label, and
    the whole URL goes into every remediation command. With `job` = `--prometheus-job`, the
    agent's alerts carry the labels Prometheus would give them. Runbook links are absolute:
    `--runbook-url`, or the runbook this agent serves at `<advertised>/runbook`."""
    from kvctl.agent.alerting import AlertLoop
    from kvctl.alerts import AlertEvaluator, AlertmanagerNotifier, PoolAlerts, post_test_alert

    runbook = config.runbook_url or f"{advertised}/runbook"
    evaluator = PoolAlerts(
        [
            AlertEvaluator(
                service.settings,
                name,
                urlsplit(advertised).netloc,
                agent_url=advertised,
                job=config.prometheus_job,
                runbook_base=runbook,
            )
            for name in service.pools
        ]
    )
    notifier = send_test = None
    if config.alertmanager_url:
        url = config.alertmanager_url
        user = config.alertmanager_basic_auth_user
        password = _secret(config.alertmanager_basic_auth_password_file, "password file")
        credentials = {
            "basic_auth": (user, password) if user and password is not None else None,
            "bearer_token": _secret(config.alertmanager_bearer_token_file, "bearer token file"),
            "ca_file": str(config.alertmanager_ca_file) if config.alertmanager_ca_file else None,
        }
        notifier = AlertmanagerNotifier(url, generator_url=f"{advertised}/v1/alerts", **credentials)

        def send_test() -> dict:
            return post_test_alert(
                url,
                pool=next(iter(service.pools)),
                instance=evaluator.instance,
                job=evaluator.job,
                runbook_base=runbook,
                **credentials,
            )

    return AlertLoop(
        evaluator,
        lambda: service.snapshots,
        lambda: service.settings,
        notifier,
        send_test=send_test,
    )


def _uvicorn_server() -> type:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn's server without its signal capture, which re-raises SIGTERM after the
        graceful shutdown (the process would then die of the signal instead of exiting 0)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return QuietServer


def serve(config: AgentConfig) -> int:
    """Bind, build, serve; return the exit code."""
    import uvicorn

    from kvctl.agent.connections import (
        bounded_protocol,
        fit_connections_to_file_limit,
        listening_socket,
        quiet_accept_errors,
    )
    from kvctl.agent.memory import keep_large_blocks_in_mmap
    from kvctl.agent.server import create_app

    keep_large_blocks_in_mmap()

    try:
        sock = listening_socket(config.host, config.port, config.max_connections)
    except OSError as error:
        raise ConfigError(
            f"cannot listen on {config.host}:{config.port}: {error.strerror}; use --port to pick "
            "another port"
        ) from None
    port = sock.getsockname()[1]
    service = build_service(config)
    kv_events = start_kv_events(config, service)
    service.kv_events = kv_events
    max_connections, backlog = fit_connections_to_file_limit(config.max_connections)
    quiet_accept_errors()
    host = f"[{config.host}]" if sock.family == socket.AF_INET6 else config.host
    advertised = config.advertised(port)
    service.alerting = alert_loop(service, config, advertised)
    api = create_app(
        service,
        config,
        on_ready=lambda: log.info(
            "listening on http://%s:%d (advertised as %s)", host, port, advertised
        ),
        run_engine=False,
        advertised=advertised,
    )
    server = _uvicorn_server()(
        uvicorn.Config(
            api,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=int(config.shutdown_grace) + 1,
            http=bounded_protocol(config.header_timeout, config.body_timeout, max_connections),
            timeout_keep_alive=max(1, round(config.keep_alive_timeout)),
            backlog=backlog,
        )
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    http = threading.Thread(
        target=asyncio.run, args=(server.serve(sockets=[sock]),), name="kvctl-http", daemon=True
    )
    http.start()
    # The engine runs on this, the main thread; SIGTERM makes it drain, then HTTP stops.
    service.run(lambda: stop.is_set() or not http.is_alive(), config.shutdown_grace)
    server.should_exit = True
    http.join(timeout=config.shutdown_grace + 5)
    if kv_events is not None:
        kv_events.close()
    log.info("stopped")
    return 0


def start_kv_events(config: AgentConfig, service: Any) -> Any:
    """The KV-events publisher of `--kv-events-endpoint`, following every pool's prefix cache
    and tiers under its model's topic (None when the flag is not given)."""
    if config.kv_events_endpoint is None:
        return None
    from kvctl.agent.kv_events import KVEventPublisher

    try:
        publisher = KVEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    hostname = socket.gethostname()
    for pool in service.pools.values():
        topic = config.kv_events_topic.format(model=pool.served.name, hostname=hostname)
        publisher.attach(pool.engine, topic)
    publisher.start(service.call)
    replay = publisher.replay_endpoint
    log.info(
        "kv events: publishing on %s%s, topics %s",
        publisher.endpoint,
        f", replay on {replay}" if replay else "",
        ", ".join(publisher.topics),
    )
    return publisher


@app.command()
def main_command(
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help=f"Port (default {DEFAULT_PORT}).")] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(
            help="`demo` (or demo:LAYERSxKV_HEADS), a checkpoint directory or a .gguf file; "
            "NAME=PATH names it. Repeatable: several models, each with its own pool, share "
            "one KV budget."
        ),
    ] = None,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(
            help="A name clients may give as `model` (repeatable; the first is the one "
            "reported; default the model's name)."
        ),
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N (default cpu).")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto, float32, float16, bfloat16.")] = None,
    page_size: Annotated[int | None, typer.Option(help="Tokens per page (default 16).")] = None,
    pool_pages: Annotated[
        int | None, typer.Option(help="Pool size in pages (default 1024).")
    ] = None,
    pool_memory: Annotated[str | None, typer.Option(help="Pool size in bytes, e.g. 2GiB.")] = None,
    gpu_memory_fraction: Annotated[
        float | None, typer.Option(help="Pool size as a share of free GPU memory.")
    ] = None,
    kv_budget: Annotated[
        str | None,
        typer.Option(
            help="Bytes all pools may hold together, e.g. 12GiB (several models: memory moves "
            "between their pools within it; default: the sum of their sizes; one model: its "
            "pool's ceiling)."
        ),
    ] = None,
    segment_pages: Annotated[
        int | None, typer.Option(help="Pages per segment (default pool/8).")
    ] = None,
    max_pool_pages: Annotated[
        int | None, typer.Option(help="Largest pool (default 4x the initial size).")
    ] = None,
    prefix_cache: Annotated[
        bool | None,
        typer.Option(
            "--prefix-cache/--no-prefix-cache",
            help="Reuse KV of shared prompt prefixes (default on).",
        ),
    ] = None,
    prefix_isolation: Annotated[
        str | None,
        typer.Option(help="salt, or sampling (also key the cache by sampling settings)."),
    ] = None,
    eviction_policy: Annotated[
        str | None, typer.Option(help=_flag_help("--eviction-policy"))
    ] = None,
    host_tier_memory: Annotated[
        str | None,
        typer.Option(
            help="Host memory that keeps prefix pages evicted from the pool, e.g. 8GiB "
            "(pinned on CUDA; default 0: none; several models share it equally)."
        ),
    ] = None,
    host_tier_policy: Annotated[
        str | None, typer.Option(help=_flag_help("--host-tier-policy"))
    ] = None,
    disk_tier_path: Annotated[
        Path | None,
        typer.Option(
            help="Directory for page files below the host tier (its *.kvpage files "
            "are removed at start; several models: a directory each under it)."
        ),
    ] = None,
    disk_tier_size: Annotated[
        str | None, typer.Option(help="Bytes the disk tier may use (default 10GiB).")
    ] = None,
    disk_tier_policy: Annotated[
        str | None, typer.Option(help=_flag_help("--disk-tier-policy"))
    ] = None,
    torch_threads: Annotated[
        int | None, typer.Option(help="CPU threads of torch (default: every core it may use).")
    ] = None,
    decode_read_path: Annotated[
        str | None,
        typer.Option(
            help="How decode reads K/V pages: paged (the CPU kernel, through the page "
            "table), flex (FlexAttention through the page table), gather (copy them together "
            "first), or auto (flex on CUDA, paged on a CPU where the kernels run, else gather; "
            "default)."
        ),
    ] = None,
    max_batch_seqs: Annotated[
        int | None, typer.Option(help="Most requests running at once (default 64).")
    ] = None,
    max_batched_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-batched-tokens",
            "--max-batch-tokens",
            help="Most tokens one engine step computes: decode tokens first, then chunks of "
            f"prompts (default {DEFAULT_MAX_BATCHED_TOKENS}; at least --max-batch-seqs).",
        ),
    ] = None,
    long_prompt_tokens: Annotated[
        int | None,
        typer.Option(
            help="A prompt with more tokens than this left to compute (after its cached prefix) "
            "is long: it is computed in capped chunks while other requests decode (default "
            f"{DEFAULT_LONG_PROMPT_TOKENS}; a prompt longer than --max-batched-tokens is always "
            "long).",
        ),
    ] = None,
    max_prefill_while_decoding: Annotated[
        int | None,
        typer.Option(
            help="Most tokens a step gives long prompts (--long-prompt-tokens) while other "
            "requests decode, so a long prompt does not stall their streams (default "
            f"{CPU_PREFILL_WHILE_DECODING} on CPU, no cap on a GPU; 0: no cap).",
        ),
    ] = None,
    max_waiting: Annotated[
        int | None,
        typer.Option(
            help=f"Most requests queued; more are answered 429 (default {DEFAULT_MAX_WAITING})."
        ),
    ] = None,
    advertise_url: Annotated[
        str | None,
        typer.Option(
            help="URL others reach this agent at: the `instance` of its alerts and the URL in "
            "their commands (default http://HOSTNAME:PORT)."
        ),
    ] = None,
    prometheus_job: Annotated[
        str | None,
        typer.Option(
            help="The `job` label of this agent's alerts: the job Prometheus scrapes it as "
            "(default kvctl-agent)."
        ),
    ] = None,
    runbook_url: Annotated[
        str | None,
        typer.Option(
            help="Absolute base of the alerts' runbook_url (default ADVERTISE-URL/runbook, "
            "served by this agent)."
        ),
    ] = None,
    report_cached_tokens: Annotated[
        bool | None,
        typer.Option(
            "--report-cached-tokens/--no-report-cached-tokens",
            help="Report usage.prompt_tokens_details.cached_tokens (default off: it tells one "
            "client whether others sent the same prefix).",
        ),
    ] = None,
    kv_events_endpoint: Annotated[
        str | None,
        typer.Option(
            help="Publish the prefix cache's page events in vLLM's KV-events format on this "
            "ZMQ endpoint: tcp://127.0.0.1:5557 or tcp://*:5557 bind (every address needs a "
            "token), tcp://HOST:PORT connects to a consumer (docs/kv-events.md; default off)."
        ),
    ] = None,
    kv_events_replay_endpoint: Annotated[
        str | None,
        typer.Option(
            help="ZMQ ROUTER endpoint that replays recent event batches from a sequence "
            "number, e.g. tcp://127.0.0.1:5558 (default none)."
        ),
    ] = None,
    kv_events_topic: Annotated[
        str | None,
        typer.Option(
            help="Topic of the KV events; {model} and {hostname} are filled in (default "
            "kv@{hostname}@{model}, what llm-d reads)."
        ),
    ] = None,
    token_file: Annotated[
        Path | None, typer.Option(help="File holding the bearer token (or set KVCTL_TOKEN).")
    ] = None,
    alertmanager_url: Annotated[
        str | None, typer.Option(help="Push alerts to this Alertmanager.")
    ] = None,
    alert_interval: Annotated[str | None, typer.Option(help=_flag_help("--alert-interval"))] = None,
    alert_for: Annotated[str | None, typer.Option(help=_flag_help("--alert-for"))] = None,
    stats_window: Annotated[
        str | None, typer.Option(help="Window of the success and hit ratios (default 5m).")
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning, error.")] = None,
    config: Annotated[
        Path | None, typer.Option(help="TOML file with any of these settings.")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="SECTION.NAME=VALUE",
            help="A runtime setting, e.g. defrag.fragmentation_threshold=0.4 (repeatable; "
            "docs/settings.md lists them).",
        ),
    ] = None,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    """Run the kvctl agent: a model on a paged KV pool, with its API, metrics and alerts."""
    if version:
        typer.echo(f"kvctl-agent {__version__}")
        raise typer.Exit(0)
    flags = {k: v for k, v in locals().items() if k not in ("config", "version", "set_")}
    flags["served_model_name"] = served_model_name or None  # typer gives [] when not given
    flags["model"] = model or None
    try:
        settings = load_config(flags, config, set_)
        logging.basicConfig(
            level=settings.log_level.upper(),
            format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
            stream=sys.stderr,
        )
        code = serve(settings)
    except ConfigError as error:
        typer.echo(f"kvctl-agent: error: {error}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvctl-agent` and `python -m kvctl.agent.main`."""
    try:
        app(args=argv, prog_name="kvctl-agent", standalone_mode=True)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
