"""What `kvctl-agent` builds from its configuration: the models, their pools and engines (as
kvctl.agent.startup.planning sizes them), the service, the alert loop, the KV-events publisher,
and the HTTP server around them.

Torch and the rest of the agent are imported inside the functions that need them, so that
`kvctl-agent --help` and a refused configuration answer without loading torch; the annotations
name the real classes (imported for type checking only).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvctl.agent.config import AgentConfig, ConfigError, ModelSpec, read_config_file
from kvctl.agent.startup.planning import (
    ModelPages,
    Plan,
    PoolPlan,
    check_names,
    demo_shape,
    log_pool_size,
    plan_pools,
)
from kvctl.settings import RuntimeSettings, SettingsError, StartupLimits, apply_changes
from kvctl.sizing import PoolFit
from kvctl.units import format_bytes

if TYPE_CHECKING:
    import uvicorn

    from kvctl.agent.model import LlamaModel, ModelConfig, Tokenizer
    from kvctl.agent.model.chat_template import ChatTemplate
    from kvctl.agent.model_pool import ModelPool
    from kvctl.agent.observe.alerting import AlertLoop
    from kvctl.agent.observe.gpu import GpuProbe
    from kvctl.agent.observe.kv_events import KVEventPublisher
    from kvctl.agent.runtime import Engine
    from kvctl.agent.service import AgentService

log = logging.getLogger("kvctl.agent")


def default_torch_threads() -> int:
    """Every core the process may run on: decode is bound by memory bandwidth, which one core
    alone cannot draw. Monitoring stays fast beside it because its routes read the snapshot the
    engine publishes and hold the GIL for well under a scheduler slice (docs/performance.md,
    "Torch threads: the default")."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


# ---- models --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedModel:
    """A model loaded for serving, with what its pool needs to know about it."""

    spec: ModelSpec
    name: str
    served_names: tuple[str, ...]
    model_config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer | None  # None: a checkpoint without tokenizer.json (token ids only)
    template: ChatTemplate | None  # None: the checkpoint has no chat template (no chat route)
    bytes_per_page: int
    page_groups: int = 1  # page tables per request (`layer_groups`)

    @property
    def pages(self) -> ModelPages:
        """What the pool plan reads of this model."""
        return ModelPages(self.name, self.spec, self.bytes_per_page)


def load_model(spec: ModelSpec, config: AgentConfig) -> LoadedModel:
    """The model of one `--model` flag or `[[models]]` table, on the configured device."""
    import torch

    from kvctl.agent.model import CheckpointError, build_demo_model, load_checkpoint
    from kvctl.agent.model.chat_template import demo_chat_template
    from kvctl.agent.model.demo import demo_config
    from kvctl.agent.pool.storage import KVStorage
    from kvctl.agent.runtime.layer_groups import page_groups

    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    shape = demo_shape(spec.path)
    tokenizer: Tokenizer | None
    template: ChatTemplate | None
    try:
        if shape is not None:
            layers, heads = shape
            shaped = dataclasses.replace(demo_config(), num_layers=layers, num_kv_heads=heads)
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
    groups = page_groups(mc, config.window_pages == "release")
    page_bytes = KVStorage.page_bytes(
        config.page_size,
        groups.size,
        mc.num_kv_heads,
        mc.head_dim,
        next(model.parameters()).dtype,
    )
    return LoadedModel(
        spec,
        name,
        tuple(names) or (name,),
        mc,
        model,
        tokenizer,
        template,
        page_bytes,
        groups.count,
    )


def _prepare_torch(config: AgentConfig) -> None:
    import torch

    torch.manual_seed(config.seed)
    torch.set_num_threads(config.torch_threads or default_torch_threads())
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"--device {config.device}: torch sees no CUDA device here; use --device cpu"
        )


def _free_device_bytes(config: AgentConfig, gpu: GpuProbe) -> int | None:
    """Free memory of the configured GPU (NVML); None on the CPU or without a reading."""
    if not config.device.startswith("cuda"):
        return None
    import torch

    return gpu.free_bytes(torch.device(config.device).index or 0)


# ---- pools and the service -----------------------------------------------------------------------


def build_service(config: AgentConfig) -> AgentService:
    """Models, pools, engines and the service, as the configuration says (imports torch)."""
    from kvctl.agent.observe.gpu import GpuProbe
    from kvctl.agent.service import AgentService

    _prepare_torch(config)
    models = [load_model(spec, config) for spec in config.model_specs()]
    check_names(config, [m.name for m in models])
    gpu = GpuProbe()
    plan = plan_pools(config, [m.pages for m in models], _free_device_bytes(config, gpu))
    # the settings are checked against the first pool's limits
    limits = plan.pools[0].limits
    defaults = limits.defaults()
    try:
        settings = apply_changes(defaults, config.settings, defaults, limits)
    except SettingsError as error:
        raise ConfigError(str(error)) from None
    pools = [
        _model_pool(config, loaded, pool, settings, several=len(models) > 1)
        for loaded, pool in zip(models, plan.pools, strict=True)
    ]
    service = AgentService(pools, settings, gpu=gpu, defaults=defaults, limits=limits)
    if plan.budget_bytes is not None:
        _share_budget(service, plan, plan.budget_bytes)
    return service


def _model_pool(
    config: AgentConfig,
    loaded: LoadedModel,
    plan: PoolPlan,
    settings: RuntimeSettings,
    several: bool,
) -> ModelPool:
    """One model's engine and pool, sized as planned."""
    from kvctl.agent.model_pool import ModelPool
    from kvctl.agent.served import ServedModel

    mc = loaded.model_config
    if several:
        log.info("model %s:", loaded.name)
    log.info("model: %s", mc.describe())
    log_pool_size(
        PoolFit(
            config.page_size,
            loaded.bytes_per_page,
            plan.capacity,
            mc.max_context_len,
            loaded.page_groups,
        )
    )
    try:
        engine = make_engine(loaded.model, loaded.tokenizer, config, plan, settings)
    except ValueError as error:  # a tier the host cannot give (memory, directory)
        raise ConfigError(str(error)) from None
    served = ServedModel(loaded.served_names, loaded.template, mc.max_context_len)
    return ModelPool(
        engine,
        loaded.name,
        plan.limits,
        served,
        window=config.stats_window,
        max_waiting=config.max_waiting,
        reload=ModelReload(loaded.spec, config),
    )


@dataclass(frozen=True)
class ModelReload:
    """Loads a model's weights again as the agent loaded them at start, for a model woken from
    a level-2 sleep (the demo model is built again from its seed)."""

    spec: ModelSpec
    config: AgentConfig

    def __call__(self) -> LlamaModel:
        return load_model(self.spec, self.config).model


def _share_budget(service: AgentService, plan: Plan, budget_bytes: int) -> None:
    """Put every pool under one KV budget, each within its planned floor and ceiling."""
    from kvctl.agent.budget import BudgetError, KvBudget

    budget = KvBudget(budget_bytes)
    for pool, pool_plan in zip(service.pools.values(), plan.pools, strict=True):
        resizer = pool.engine.resizer
        resizer.min_pages, resizer.max_pages = pool_plan.floor, pool_plan.ceiling
        try:
            budget.add(pool.name, resizer)
        except BudgetError as error:
            raise ConfigError(str(error)) from None
    service.share_budget(budget)
    log.info(
        "KV budget %s shared by %d pools: %s assigned, %s unassigned",
        format_bytes(budget_bytes),
        len(plan.pools),
        format_bytes(budget.assigned_bytes),
        format_bytes(budget.unassigned_bytes),
    )


def make_engine(
    model: LlamaModel,
    tokenizer: Tokenizer | None,
    config: AgentConfig,
    plan: PoolPlan,
    settings: RuntimeSettings,
) -> Engine:
    """The engine the flags and the plan describe (its pool, prefix cache and tiers)."""
    from kvctl.agent.runtime import Engine, EngineConfig

    limits: StartupLimits = plan.limits
    return Engine(
        model,
        tokenizer,
        EngineConfig(
            device=config.device,
            page_size=config.page_size,
            pool_pages=plan.pages,
            segment_pages=plan.segment,
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
            release_window_pages=config.window_pages == "release",
            host_tier_bytes=plan.tiers.host_bytes,
            host_tier_policy=settings.prefix_cache.host_tier_policy,
            disk_tier_path=plan.tiers.disk_path,
            disk_tier_bytes=plan.tiers.disk_bytes,
            disk_tier_policy=settings.prefix_cache.disk_tier_policy,
        ),
    )


# ---- alerts and KV events ------------------------------------------------------------------------


@dataclass(frozen=True)
class AlertmanagerAuth:
    """How the agent authenticates to Alertmanager (each None when not configured)."""

    basic_auth: tuple[str, str] | None
    bearer_token: str | None
    ca_file: str | None

    @classmethod
    def of(cls, config: AgentConfig) -> AlertmanagerAuth:
        user = config.alertmanager_basic_auth_user
        password = _secret(
            config.alertmanager_basic_auth_password_file, "alertmanager_basic_auth_password_file"
        )
        return cls(
            (user, password) if user and password is not None else None,
            _secret(config.alertmanager_bearer_token_file, "alertmanager_bearer_token_file"),
            str(config.alertmanager_ca_file) if config.alertmanager_ca_file else None,
        )


def _secret(path: Path | None, flag: str) -> str | None:
    if path is None:
        return None
    return read_config_file(path, flag).strip()


def alert_loop(service: AgentService, config: AgentConfig, advertised: str) -> AlertLoop:
    """The alert evaluator, and the Alertmanager notifier when `--alertmanager-url` is set.

    `advertised` is the agent's URL as others reach it: its authority (`host:port`, what
    Prometheus attaches as `instance` when it scrapes that address) is the `instance` label, and
    the whole URL goes into every remediation command. With `job` = `--prometheus-job`, the
    agent's alerts carry the labels Prometheus would give them. Runbook links are absolute:
    `--runbook-url`, or the runbook this agent serves at `<advertised>/runbook`."""
    from kvctl.agent.observe.alerting import AlertLoop
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
    url = config.alertmanager_url
    if url is None:
        return AlertLoop(evaluator, lambda: service.snapshots, lambda: service.settings)
    auth = AlertmanagerAuth.of(config)
    notifier = AlertmanagerNotifier(
        url,
        generator_url=f"{advertised}/v1/alerts",
        basic_auth=auth.basic_auth,
        bearer_token=auth.bearer_token,
        ca_file=auth.ca_file,
    )

    def send_test() -> dict[str, Any]:
        return post_test_alert(
            url,
            pool=next(iter(service.pools)),
            instance=evaluator.instance,
            job=evaluator.job,
            runbook_base=runbook,
            basic_auth=auth.basic_auth,
            bearer_token=auth.bearer_token,
            ca_file=auth.ca_file,
        )

    return AlertLoop(
        evaluator,
        lambda: service.snapshots,
        lambda: service.settings,
        notifier,
        send_test=send_test,
    )


def start_kv_events(config: AgentConfig, service: AgentService) -> KVEventPublisher | None:
    """The KV-events publisher of `--kv-events-endpoint`, following every pool's prefix cache
    and tiers under its model's topic; None when the flag is not given (no events go out)."""
    if config.kv_events_endpoint is None:
        return None
    from kvctl.agent.observe.kv_events import KVEventPublisher

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


# ---- serving -------------------------------------------------------------------------------------


def _uvicorn_server() -> type[uvicorn.Server]:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn's server without its signal capture, which re-raises SIGTERM after the
        graceful shutdown (the process would then die of the signal instead of exiting 0)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return QuietServer


def serve(config: AgentConfig) -> int:
    """Bind, build, serve until SIGTERM; return the exit code."""
    import uvicorn

    from kvctl.agent.http.connections import (
        bounded_protocol,
        fit_connections_to_file_limit,
        listening_socket,
        quiet_accept_errors,
    )
    from kvctl.agent.http.server import create_app
    from kvctl.agent.memory import configure_malloc

    configure_malloc()

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
