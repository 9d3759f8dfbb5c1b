"""The agent's start-up configuration: command-line flags over an optional TOML file.

Each field of `AgentConfig` is the whole definition of one start-up setting: its type, default,
range, help and flag (`startup(...)`). kvctl.agent.startup.settings reads them to build the
options of `kvctl-agent`, the keys the TOML file accepts and the "Start-up settings" part of
docs/settings.md. A flag is its key with dashes (`--page-size` is `page_size`); a flag given on
the command line wins over the file; a few settings are file-only. Runtime settings
(kvctl.settings) come in three ways, in rising precedence: `[section]` tables of the TOML file,
their named flags (`--alert-interval`, also a flat TOML key `alert_interval`), and
`--set section.name=value`. Unknown keys, bad values and contradictory choices (two ways of
sizing the pool, a public address without a token, a token written into the file) are refused
before anything starts, with one line that names the key and what to write instead.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import stat
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from kvctl import settings as runtime
from kvctl.api import DEFAULT_PORT, MaxTokens
from kvctl.units import format_bytes, parse_duration, parse_size

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})
KV_EVENTS_TOPIC = "kv@{hostname}@{model}"
"""The KV events' default topic: llm-d subscribes to `kv@` and reads `kv@POD@MODEL`."""
DEFAULT_MAX_WAITING = 256
DEFAULT_POOL_PAGES = 1024
"""The pool's size when neither --pool-pages, --pool-memory, --gpu-memory-fraction nor
--kv-budget sizes it."""
DEFAULT_SEGMENTS = 8
"""Segments in a pool whose segment size is not given: a segment is an eighth of its start size."""
CEILING_FACTOR = 4
"""A lone pool's ceiling without --max-pool-pages or --kv-budget: this many times its start size."""
DEFAULT_DISK_TIER_BYTES = 10 << 30
"""The disk tier's size when only --disk-tier-path is given."""
DEFAULT_MAX_BATCHED_TOKENS = 2048
"""Tokens one engine step computes at most (decode tokens + prompt chunks). A wave of prompts
computed in one step keeps the matrix products compute-bound and the decode steps free of prompt
chunks (docs/performance.md, "Serving side by side with vLLM"; docs/architecture.md, "Chunked
prefill: the token budget of a step")."""
DEFAULT_LONG_PROMPT_TOKENS = 512
"""With --max-prefill-while-decoding set, a prompt with more tokens than this left to compute is
long: while other requests decode it is computed in capped chunks so their streams' gaps stay
small, at the cost of its own first token (docs/performance.md, "Choosing the scheduling
policy"). Off by default."""

MAX_CONFIG_BYTES = 1 << 20
"""The largest config file (or token file) the agent reads: a real one is a few KiB, and the
bound keeps a wrong path (a log file, a link to /dev/zero) from filling memory."""
MAX_CONFIG_DEPTH = 32
"""The deepest nesting of arrays, inline tables and dotted keys' parts a config file may have
(the settings need 3): tomllib recurses once per bracket, so a deep file would exhaust Python's
stack, and its time and memory grow with the square of a dotted key's parts (20 GB for 10^5)."""
MAX_MODELS = 64
"""The most models one agent serves: each is loaded and gets a pool before it serves, so a
file listing thousands would fill memory before anything said no."""

StartupUnit = Literal["", "bytes", "seconds"]


def startup(
    default: Any,
    help: str,
    *,
    flag: bool = True,
    unit: StartupUnit = "",
    default_text: str | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A start-up setting's field: its default, its help (one or more sentences, without the
    default: the help and the docs add it), and how it is given.

    `flag=False`: a key of the TOML file only. `unit`: "bytes" (the flag takes "2GiB"),
    "seconds" (it takes "5m"). `default_text`: the default in words, where the field's default
    (None: not given) is resolved later, e.g. "every core it may use". `aliases`: former names,
    accepted as a key and as a flag."""
    extra: dict[str, Any] = {"flag": flag, "unit": unit, "aliases": list(aliases)}
    if default_text is not None:
        extra["default_text"] = default_text
    return Field(default, description=help, json_schema_extra={"startup": extra})


class ConfigError(ValueError):
    """A configuration the agent refuses to start with; the message is one line."""


class ModelSpec(BaseModel):
    """One model the agent serves: a `[[models]]` table of the TOML file, or one `--model`
    flag (`PATH`, or `NAME=PATH`). The sizes bound this model's pool; unset ones come from the
    top-level flags, then from the budget (an equal share of it by bytes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(
        default=None, description="The pool's name and the model's first served name."
    )
    path: str = Field(
        default="demo",
        description="demo[:LAYERSxKV_HEADS], a checkpoint directory or a .gguf file.",
    )
    served_model_name: list[str] = Field(default=[], description="More names clients may ask for.")
    pool_pages: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="This pool's start size in pages."
    )
    pool_memory: int | None = Field(
        default=None, description='This pool\'s start size in bytes ("2GiB").'
    )
    segment_pages: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="This pool's pages per segment."
    )
    min_pool_pages: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="The pool's floor: the budget never shrinks it below."
    )
    max_pool_pages: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="The pool's ceiling."
    )

    @field_validator("pool_memory", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or len(value) > 256 or "/" in value):
            raise ValueError("a model's name is 1 to 256 characters, not blank, without '/'")
        return value

    @model_validator(mode="after")
    def _one_size(self) -> ModelSpec:
        if self.pool_pages and self.pool_memory:
            raise ValueError("give a model pool_pages or pool_memory, not both")
        if (
            self.min_pool_pages
            and self.max_pool_pages
            and self.min_pool_pages > self.max_pool_pages
        ):
            raise ValueError(
                f"min_pool_pages {self.min_pool_pages} is above max_pool_pages "
                f"{self.max_pool_pages}"
            )
        return self

    @classmethod
    def parse(cls, flag: str) -> ModelSpec:
        """`--model PATH` or `--model NAME=PATH` (a NAME has no '/': a path may hold '=')."""
        name, sep, path = flag.partition("=")
        if sep and "/" not in name:
            if not name or not path:
                raise ValueError(f"--model {flag!r}: write NAME=PATH, e.g. small=demo")
            return cls(name=name, path=path)
        return cls(path=flag)


class AgentConfig(BaseModel):
    """What `kvctl-agent` runs with: one field per start-up setting (flags and TOML keys have
    the same names); docs/settings.md lists them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = startup("127.0.0.1", "Address to bind.")
    port: Annotated[int, Field(ge=0, le=65535)] = startup(DEFAULT_PORT, "Port.")
    model: list[str] = startup(
        ["demo"],
        "`demo` (or demo:LAYERSxKV_HEADS), a checkpoint directory or a .gguf file; NAME=PATH "
        "names it. Repeatable: several models, each with its own pool, share one KV budget.",
    )
    models: list[ModelSpec] = startup(
        [],
        "`[[models]]` tables, one per model with its own pool, instead of --model flags "
        "(their keys are listed below).",
        flag=False,
        default_text="the --model flags",
    )
    served_model_name: list[str] = startup(
        [],
        "A name clients may give as `model` (repeatable; the first is the one reported).",
        default_text="the model's name",
    )
    device: str = startup("cpu", "cpu, cuda or cuda:N.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = startup(
        "auto", "auto, float32, float16, bfloat16."
    )
    page_size: Annotated[int, Field(ge=1, le=4096)] = startup(16, "Tokens per page.")
    pool_pages: Annotated[int, Field(ge=1)] | None = startup(
        None, "Pool size in pages.", default_text=str(DEFAULT_POOL_PAGES)
    )
    pool_memory: int | None = startup(None, "Pool size in bytes, e.g. 2GiB.", unit="bytes")
    gpu_memory_fraction: Annotated[float, Field(gt=0.0, le=1.0)] | None = startup(
        None, "Pool size as a share of free GPU memory."
    )
    kv_budget: int | None = startup(
        None,
        "Bytes all pools may hold together, e.g. 12GiB: with several models, memory moves "
        "between their pools within it; with one, it is its pool's ceiling (and size unless "
        "one is given).",
        unit="bytes",
        default_text="the sum of the pools' sizes",
    )
    segment_pages: Annotated[int, Field(ge=1)] | None = startup(
        None, "Pages per segment.", default_text=f"pool/{DEFAULT_SEGMENTS}"
    )
    max_pool_pages: Annotated[int, Field(ge=1)] | None = startup(
        None, "Largest pool.", default_text=f"{CEILING_FACTOR}x the initial size"
    )
    prefix_cache: bool = startup(True, "Reuse KV of shared prompt prefixes.")
    prefix_isolation: Literal["salt", "sampling"] = startup(
        "salt", "salt, or sampling (also key the cache by sampling settings)."
    )
    window_pages: Literal["release", "keep"] = startup(
        "release",
        "release: a model's sliding-window layers keep pages of their own and give back those "
        "their window has left while the request runs; keep: every layer keeps every page.",
    )
    host_tier_memory: int = startup(
        0,
        "Host memory that keeps prefix pages evicted from the pool, e.g. 8GiB; 0: none "
        "(pinned on CUDA; several models share it equally).",
        unit="bytes",
    )
    disk_tier_path: Path | None = startup(
        None,
        "Directory for page files below the host tier (its *.kvpage files are removed at "
        "start; several models: a directory each under it).",
        default_text="none: no disk tier",
    )
    disk_tier_size: int | None = startup(
        None,
        "Bytes the disk tier may use (with --disk-tier-path).",
        unit="bytes",
        default_text=f"{DEFAULT_DISK_TIER_BYTES >> 30}GiB",
    )
    torch_threads: Annotated[int, Field(ge=1, le=1024)] | None = startup(
        None, "CPU threads of torch.", default_text="every core it may use"
    )
    decode_read_path: Literal["auto", "paged", "gather", "flex"] = startup(
        "auto",
        "How decode reads K/V pages: paged (the CPU kernel, through the page table), flex "
        "(FlexAttention through the page table), gather (copy them together first), or auto "
        "(flex on CUDA, paged on a CPU where the kernels run, else gather).",
    )
    max_batch_seqs: Annotated[int, Field(ge=1, le=4096)] = startup(
        64, "Most requests running at once."
    )
    max_batched_tokens: Annotated[int, Field(ge=1, le=1 << 20)] = startup(
        DEFAULT_MAX_BATCHED_TOKENS,
        "Most tokens one engine step computes: decode tokens first, then chunks of prompts "
        "(at least --max-batch-seqs).",
        aliases=("max_batch_tokens",),
    )
    long_prompt_tokens: Annotated[int, Field(ge=1, le=1 << 20)] = startup(
        DEFAULT_LONG_PROMPT_TOKENS,
        "A prompt with more tokens than this left to compute (after its cached prefix) is "
        "long: it is computed in capped chunks while other requests decode (a prompt longer "
        "than --max-batched-tokens is always long).",
    )
    max_prefill_while_decoding: Annotated[int, Field(ge=0, le=1 << 20)] = startup(
        0,
        "Most tokens a step gives long prompts (--long-prompt-tokens) while other requests "
        "decode: smaller gaps between their tokens for a strict inter-token SLO, paid by the long "
        "prompts' first tokens and by throughput; 0: no cap (each step fills its budget, running "
        "requests first).",
    )
    max_tokens_limit: MaxTokens = startup(
        1024, "Largest `max_tokens` a request may ask for.", flag=False
    )
    max_prompt_tokens: Annotated[int, Field(ge=1)] = startup(
        8192, "Longest prompt a request may send, in tokens.", flag=False
    )
    max_body_bytes: Annotated[int, Field(ge=1024)] = startup(
        1 << 20, "Largest request body, in bytes.", flag=False
    )
    max_waiting: Annotated[int, Field(ge=1, le=1 << 20)] = startup(
        DEFAULT_MAX_WAITING, "Most requests queued; more are answered 429."
    )
    header_timeout: float = startup(
        10.0, "Time a client has to send a request's headers.", flag=False, unit="seconds"
    )
    body_timeout: float = startup(
        30.0, "Time a client has to send a request's body.", flag=False, unit="seconds"
    )
    keep_alive_timeout: float = startup(
        5.0, "Time an idle keep-alive connection is kept.", flag=False, unit="seconds"
    )
    max_connections: Annotated[int, Field(ge=16, le=1 << 20)] = startup(
        2048,
        "Most open connections (fitted to the open-file limit); past it idle ones are closed, "
        "never-used first and answered keep-alive ones last.",
        flag=False,
    )
    advertise_url: str | None = startup(
        None,
        "URL others reach this agent at: the `instance` of its alerts and the URL in their "
        "commands.",
        default_text="http://HOSTNAME:PORT",
    )
    prometheus_job: str = startup(
        "kvctl-agent",
        "The `job` label of this agent's alerts: the job Prometheus scrapes it as.",
    )
    runbook_url: str | None = startup(
        None,
        "Absolute base of the alerts' runbook_url.",
        default_text="ADVERTISE-URL/runbook, served by this agent",
    )
    report_cached_tokens: bool = startup(
        False,
        "Report usage.prompt_tokens_details.cached_tokens (it tells one client whether "
        "others sent the same prefix).",
    )
    kv_events_endpoint: str | None = startup(
        None,
        "Publish the prefix cache's page events in vLLM's KV-events format on this ZMQ "
        "endpoint: tcp://127.0.0.1:5557 or tcp://*:5557 bind (every address needs a token), "
        "tcp://HOST:PORT connects to a consumer (docs/kv-events.md).",
        default_text="off",
    )
    kv_events_replay_endpoint: str | None = startup(
        None,
        "ZMQ ROUTER endpoint that replays recent event batches from a sequence number, e.g. "
        "tcp://127.0.0.1:5558.",
    )
    kv_events_topic: str = startup(
        KV_EVENTS_TOPIC,
        "Topic of the KV events; {model} and {hostname} are filled in (llm-d reads the default).",
    )
    token_file: Path | None = startup(
        None,
        "File holding the bearer token.",
        default_text="KVCTL_TOKEN, if set",
    )
    alertmanager_url: str | None = startup(None, "Push alerts to this Alertmanager.")
    alertmanager_bearer_token_file: Path | None = startup(
        None, "File holding the bearer token Alertmanager wants.", flag=False
    )
    alertmanager_basic_auth_user: str | None = startup(
        None,
        "User of Alertmanager's basic auth (with alertmanager_basic_auth_password_file).",
        flag=False,
    )
    alertmanager_basic_auth_password_file: Path | None = startup(
        None, "File holding the password of Alertmanager's basic auth.", flag=False
    )
    alertmanager_ca_file: Path | None = startup(
        None, "CA bundle that Alertmanager's TLS certificate is checked against.", flag=False
    )
    stats_window: float = startup(300.0, "Window of the success and hit ratios.", unit="seconds")
    shutdown_grace: float = startup(
        10.0,
        "Time running requests get to finish after SIGTERM; the rest are aborted.",
        flag=False,
        unit="seconds",
    )
    seed: int = startup(0, "Seed of torch's random numbers (sampling).", flag=False)
    log_level: Literal["debug", "info", "warning", "error"] = startup(
        "info", "debug, info, warning, error."
    )

    # Not start-up settings: filled in by load_config, never a flag or a TOML key.
    settings: dict[str, dict[str, Any]] = {}  # runtime settings given at start-up
    token: str | None = Field(default=None, exclude=True, repr=False)  # read from token_file/env

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, values: Any) -> Any:
        """A former key (`max_batch_tokens`) is another name of its setting's."""
        if isinstance(values, dict) and ALIASES.keys() & values.keys():
            values = dict(values)
            for old_key, key in ALIASES.items():
                if old_key not in values:
                    continue
                old = values.pop(old_key)
                if old is not None and values.get(key) not in (None, old):
                    raise ValueError(f"{old_key} is another name of {key}; give one of them")
                if old is not None:
                    values[key] = old
        return values

    @field_validator("model", mode="before")
    @classmethod
    def _models(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("model", "models", mode="before")
    @classmethod
    def _at_most_max_models(cls, value: Any) -> Any:
        """Counted before each table is validated, so that a long list costs nothing."""
        if isinstance(value, list) and len(value) > MAX_MODELS:
            raise ValueError(f"at most {MAX_MODELS} models, not {len(value)}")
        return value

    @field_validator(
        "pool_memory", "host_tier_memory", "disk_tier_size", "kv_budget", mode="before"
    )
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)

    @property
    def disk_tier_bytes(self) -> int:
        """The disk tier's size: as given, DEFAULT_DISK_TIER_BYTES with only a path, 0 without
        a path."""
        if self.disk_tier_path is None:
            return 0
        return self.disk_tier_size if self.disk_tier_size is not None else DEFAULT_DISK_TIER_BYTES

    @field_validator(
        "shutdown_grace",
        "stats_window",
        "header_timeout",
        "body_timeout",
        "keep_alive_timeout",
        mode="before",
    )
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return parse_duration(value)

    @field_validator("stats_window", "header_timeout", "body_timeout", "keep_alive_timeout")
    @classmethod
    def _positive_interval(cls, value: float) -> float:
        if not 0 < value <= 86400:
            raise ValueError("must be a positive duration of at most a day, such as 15s")
        return value

    @field_validator("settings")
    @classmethod
    def _runtime_settings(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        runtime.validate(value)  # the start-up limits are checked once the pool is sized
        return value

    @field_validator("runbook_url")
    @classmethod
    def _runbook_url(cls, value: str | None) -> str | None:
        """Absolute: a link in a notification has no base to be relative to."""
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(
                "must be an absolute http(s) URL such as https://wiki.example.com/kvctl/alerts, "
                f"got {value!r}"
            )
        return value.rstrip("/")

    @field_validator("prometheus_job")
    @classmethod
    def _job(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name the job Prometheus scrapes the agents as")
        return value

    @field_validator("advertise_url")
    @classmethod
    def _advertise_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"must be an http(s) URL such as http://gpu-node-1:8477, got {value!r}"
            )
        if parts.hostname in WILDCARD_HOSTS:
            raise ValueError(
                f"{value} is a wildcard address nobody can reach; give the node's name or address"
            )
        return value.rstrip("/")

    @field_validator("served_model_name")
    @classmethod
    def _served_names(cls, value: list[str]) -> list[str]:
        if any(not name.strip() or len(name) > 256 for name in value):
            raise ValueError("each served model name is 1 to 256 characters, not blank")
        if len(set(value)) != len(value):
            raise ValueError(f"served model names repeat: {value}")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value != "cpu" and not value.startswith("cuda"):
            raise ValueError("must be cpu, cuda or cuda:N")
        return value

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            zmq_endpoint_binds(value)  # ValueError names what to write
        return value

    @field_validator("kv_events_topic")
    @classmethod
    def _kv_events_topic(cls, value: str) -> str:
        try:
            value.format(model="m", hostname="h")
        except (KeyError, IndexError, ValueError):
            raise ValueError(
                "only {model} and {hostname} are filled in (write {{ and }} for braces), "
                f"got {value!r}"
            ) from None
        return value

    def model_specs(self) -> list[ModelSpec]:
        """The models to serve: the `[[models]]` tables, or the `--model` flags."""
        if self.models:
            return list(self.models)
        specs = [ModelSpec.parse(flag) for flag in self.model]
        if len(specs) == 1 and self.served_model_name:
            spec = specs[0]
            names = [spec.name] if spec.name else []
            return [spec.model_copy(update={"served_model_name": names + self.served_model_name})]
        return specs

    @model_validator(mode="after")
    def _several_models(self) -> AgentConfig:
        if self.models and self.model != ["demo"]:
            raise ValueError("give the models as --model flags or as [[models]] tables, not both")
        try:
            specs = self.model_specs()
        except ValueError as error:
            raise ValueError(str(error)) from None
        if len(specs) > 1:
            if self.served_model_name:
                raise ValueError(
                    "--served-model-name names one model; with several, name each one "
                    "(--model NAME=PATH, or name and served_model_name in [[models]])"
                )
            named = [spec.name for spec in specs if spec.name]
            if len(set(named)) != len(named):
                raise ValueError(f"two models have the same name: {named}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise ValueError("--kv-budget must be more than 0 bytes")
        if self.kv_budget and self.gpu_memory_fraction and len(specs) > 1:
            raise ValueError(
                "with several models, --gpu-memory-fraction sets the budget: give it or "
                "--kv-budget, not both"
            )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> AgentConfig:
        sizes = [
            n for n in ("pool_pages", "pool_memory", "gpu_memory_fraction") if getattr(self, n)
        ]
        if len(sizes) > 1:
            raise ValueError(
                f"give one of --pool-pages, --pool-memory, --gpu-memory-fraction, not {sizes}"
            )
        if self.gpu_memory_fraction and self.device == "cpu":
            raise ValueError(
                "--gpu-memory-fraction needs --device cuda; use --pool-pages or --pool-memory"
            )
        if self.max_pool_pages and self.pool_pages and self.pool_pages > self.max_pool_pages:
            raise ValueError(
                f"--pool-pages {self.pool_pages} is above --max-pool-pages {self.max_pool_pages}"
            )
        if self.max_batched_tokens < self.max_batch_seqs:
            raise ValueError(
                f"--max-batched-tokens {self.max_batched_tokens} is below --max-batch-seqs "
                f"{self.max_batch_seqs}: every running request decodes a token in every step"
            )
        tiered = self.host_tier_memory or self.disk_tier_path is not None
        if tiered and not self.prefix_cache:
            raise ValueError(
                "--host-tier-memory and --disk-tier-path keep evicted prefix pages: they need "
                "the prefix cache (drop --no-prefix-cache)"
            )
        if self.disk_tier_size is not None and self.disk_tier_path is None:
            raise ValueError("--disk-tier-size needs --disk-tier-path DIR")
        if self.disk_tier_path is not None and self.disk_tier_bytes < 1:
            raise ValueError("--disk-tier-size must be more than 0 bytes")
        self._check_kv_events()
        if self.alertmanager_bearer_token_file and self.alertmanager_basic_auth_user:
            raise ValueError("give Alertmanager a bearer token or basic auth, not both")
        if bool(self.alertmanager_basic_auth_user) != bool(
            self.alertmanager_basic_auth_password_file
        ):
            raise ValueError(
                "alertmanager_basic_auth_user and alertmanager_basic_auth_password_file go together"
            )
        return self

    def _check_kv_events(self) -> None:
        """Refuse event flags that cannot work together (the token rule is `load_config`'s)."""
        endpoint, replay = self.kv_events_endpoint, self.kv_events_replay_endpoint
        if replay is not None and endpoint is None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if endpoint is None:
            return
        if not self.prefix_cache:
            raise ValueError(
                "--kv-events-endpoint publishes the prefix cache's pages: it needs the prefix "
                "cache (drop --no-prefix-cache)"
            )
        if replay is not None and not zmq_endpoint_binds(replay):
            raise ValueError(
                f"--kv-events-replay-endpoint {replay}: the replay socket binds; give "
                "tcp://*:PORT, tcp://127.0.0.1:PORT or ipc://PATH"
            )
        if replay == endpoint and not endpoint.endswith(":0"):  # port 0: two free ports
            raise ValueError("--kv-events-endpoint and --kv-events-replay-endpoint must differ")
        if len(self.model_specs()) > 1 and "{model}" not in self.kv_events_topic:
            raise ValueError(
                "with several models, --kv-events-topic needs {model}: each pool's events go "
                "out under its model's topic"
            )

    def kv_events_public(self) -> list[str]:
        """The event endpoints that bind an address other hosts can reach."""
        given = (self.kv_events_endpoint, self.kv_events_replay_endpoint)
        return [e for e in given if e is not None and zmq_endpoint_binds(e) and not _local(e)]

    def advertised(self, port: int) -> str:
        """The URL other machines reach this agent at: `--advertise-url`, or the host name
        with the bound port (never a wildcard address)."""
        if self.advertise_url:
            return self.advertise_url
        host = self.host if self.host not in WILDCARD_HOSTS else socket.gethostname()
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def startup_extra(field: FieldInfo) -> dict[str, Any] | None:
    """What `startup(...)` recorded on a field of AgentConfig; None for the two fields that are
    not start-up settings (`settings`, `token`)."""
    extra = field.json_schema_extra
    found = extra.get("startup") if isinstance(extra, dict) else None
    return found if isinstance(found, dict) else None


STARTUP_KEYS: tuple[str, ...] = tuple(
    name for name, field in AgentConfig.model_fields.items() if startup_extra(field) is not None
)
"""Every start-up setting's key (TOML key, and flag with dashes unless file-only), in order."""

ALIASES: dict[str, str] = {
    old: name
    for name, field in AgentConfig.model_fields.items()
    for old in (startup_extra(field) or {}).get("aliases", [])
}
"""Former keys, by the key they are another name of (`max_batch_tokens`: `max_batched_tokens`)."""


def zmq_endpoint_binds(endpoint: str) -> bool:
    """Whether a KV-events endpoint is bound (True) or connected to (False), as vLLM decides,
    but loopback addresses bind too: `tcp://*:PORT`, `tcp://127.0.0.1:PORT`, `tcp://[::1]:PORT`,
    `tcp://localhost:PORT` and `ipc://PATH` bind; `tcp://HOST:PORT` connects to a consumer
    that binds (llm-d's global socket). ValueError for anything else."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme == "ipc" and sep and rest:
        return True
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or not host or not port.isdigit():
        raise ValueError(
            f"{endpoint!r}: write tcp://HOST:PORT (tcp://*:5557 binds every address, "
            "tcp://127.0.0.1:5557 this node only, tcp://consumer:5557 connects) or ipc://PATH"
        )
    if int(port) > 65535:
        raise ValueError(f"{endpoint!r}: the port must be 0 to 65535")
    binds = host in ("*", *WILDCARD_HOSTS) or _local(endpoint)
    if not binds and int(port) == 0:
        raise ValueError(f"{endpoint!r}: port 0 only binds (give the consumer's port)")
    return binds


def _local(endpoint: str) -> bool:
    """An ipc endpoint, or a tcp one on a loopback address."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc":
        return True
    host = rest.rpartition(":")[0].removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_config_file(path: Path, label: str) -> str:
    """The text of a file named by a flag (`label`: "--config", "--token-file"): a regular file
    of at most MAX_CONFIG_BYTES of UTF-8, else ConfigError. A FIFO, device, socket or directory
    is refused before it is opened, and again on the descriptor, opened without blocking: one
    swapped in between can neither hang the agent nor be read without end."""
    try:
        _regular(os.stat(path).st_mode, path, label)
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(descriptor, "rb") as file:
            _regular(os.fstat(descriptor).st_mode, path, label)
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{label} {path}: {error.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{label} {path}: larger than {format_bytes(MAX_CONFIG_BYTES)}, "
            "the most a config file may be"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{label} {path}: not UTF-8 text "
            f"(byte 0x{data[error.start]:02x} at offset {error.start})"
        ) from None


_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _regular(mode: int, path: Path, label: str) -> None:
    if not stat.S_ISREG(mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(mode), "a special file")
        raise ConfigError(f"{label} {path}: not a regular file ({kind})")


_TOML_TOKEN = re.compile(r"""[\[\]{}"'#.\n=,]""")
"""Where the nesting scan stops: brackets, the start of a string or a comment, a dotted key's
dot, and what ends a key."""
_TOML_STRING_END = {
    '"""': re.compile(r'(?:[^"\\]|\\.|"(?!""))*+"""(?:""?)?', re.DOTALL),
    "'''": re.compile(r"(?:[^']|'(?!''))*+'''(?:''?)?"),
    '"': re.compile(r'(?:[^"\\\n]|\\.)*+"'),
    "'": re.compile(r"[^'\n]*+'"),
}
"""From just after a string's opening quotes to just after its closing ones (a multi-line
string may end with one or two quotes of its own)."""


def _check_nesting(text: str, source: str) -> None:
    """Refuse nesting deeper than MAX_CONFIG_DEPTH in one linear pass, before tomllib reads
    `text`: brackets count outside strings and comments, and so do a dotted key's parts."""
    depth = parts = at = 0
    while match := _TOML_TOKEN.search(text, at):
        token, at = match.group(), match.end()
        if token in "[{":
            depth, parts = depth + 1, 0
        elif token in "]}":
            depth, parts = max(depth - 1, 0), 0
        elif token == ".":
            parts += 1
        elif token in "\n=,":
            parts = 0
        elif token == "#":
            at = text.find("\n", at)
            if at < 0:
                return
        else:
            opening = text[match.start() : match.start() + 3]
            opening = opening if opening in ('"""', "'''") else token
            end = _TOML_STRING_END[opening].match(text, match.start() + len(opening))
            if end is None:
                return  # a string left open: tomllib says where
            at = end.end()
        if depth + parts > MAX_CONFIG_DEPTH:
            line = text.count("\n", 0, match.start()) + 1
            raise ConfigError(
                f"{source}: line {line}: nested deeper than {MAX_CONFIG_DEPTH} levels "
                "(arrays, inline tables and the parts of dotted keys)"
            )


def _read_toml(path: Path) -> dict[str, Any]:
    source = f"--config {path}"
    text = read_config_file(path, "--config")
    _check_nesting(text, source)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{source}: not valid TOML: {error}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to read") from None
    values = {key.replace("-", "_"): value for key, value in data.items()}
    for old, key in ALIASES.items():  # the former name, so that a flag can override it
        if old not in values:
            continue
        if key in values:
            raise ConfigError(f"{source}: {old} is another name of {key}; give one of them")
        values[key] = values.pop(old)
    unknown = [key for key in values if key not in toml_keys() and key != "token"]  # refused later
    if unknown:
        raise ConfigError(f"{source}: {unknown[0]}: {UNKNOWN_KEY}")
    return values


UNKNOWN_KEY = "unknown setting; see docs/settings.md (or `kvctl-agent --help`) for the valid ones"


def toml_keys() -> frozenset[str]:
    """The top-level keys a TOML file may hold: every start-up setting, the runtime settings'
    named flags (`alert_interval`) and their `[section]` tables."""
    return frozenset(STARTUP_KEYS) | FLAG_KEYS.keys() | runtime.SECTIONS.keys()


def _read_token(config: AgentConfig) -> str | None:
    if config.token_file is not None:
        token = read_config_file(config.token_file, "--token-file").strip()
        if not token:
            raise ConfigError(f"--token-file {config.token_file} is empty")
        return token
    return os.environ.get("KVCTL_TOKEN") or None


def _one_line(error: ValidationError, source: str) -> str:
    first = error.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, runtime.SettingsError):
        return f"{source}: {cause}"
    where = ".".join(str(part) for part in first["loc"]) or "config"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = UNKNOWN_KEY
    return f"{source}: {where}: {message}"


FLAG_KEYS = {
    flag.removeprefix("--").replace("-", "_"): spec for flag, spec in runtime.FLAGS.items()
}
"""Runtime settings with a named flag, by the flag's config key (`alert_interval`)."""


def _runtime_layers(
    values: dict[str, Any], assignments: list[str] | None
) -> dict[str, dict[str, Any]]:
    """Pop the runtime settings out of `values` (TOML tables, flat flag keys) and add the
    `--set KEY=VALUE` assignments: one nested set of changes, later ways winning."""
    tables = {
        name: values.pop(name)
        for name in list(values)
        if name in runtime.SECTIONS and isinstance(values[name], dict)  # not `prefix_cache = true`
    }
    named = {}
    for key, spec in FLAG_KEYS.items():
        if key in values:
            value = values.pop(key)
            named[spec.key] = value if isinstance(value, str) else json.dumps(value)
    pairs = {}
    for assignment in assignments or []:
        key, sep, text = assignment.partition("=")
        if not sep or not key.strip():
            raise runtime.SettingsError(
                assignment, "write --set SECTION.NAME=VALUE, e.g. defrag.enabled=false"
            )
        pairs[key.strip()] = text
    return runtime.merge(
        runtime.from_toml(tables), runtime.from_text(named), runtime.from_text(pairs)
    )


def load_config(
    flags: dict[str, Any], config_file: Path | None = None, assignments: list[str] | None = None
) -> AgentConfig:
    """The configuration from `flags` (None means not given) over the TOML file's values, with
    `--set` `assignments` of runtime settings last."""
    from_file: dict[str, Any] = _read_toml(config_file) if config_file else {}
    source = f"--config {config_file}" if config_file else "kvctl-agent"
    if "token" in from_file:
        raise ConfigError(
            f"{source}: token: do not write the token into the config file; put it in a file "
            "readable only by the agent and give token_file, or set KVCTL_TOKEN"
        )
    values = {**from_file, **{k: v for k, v in flags.items() if v is not None}}
    values.pop("token", None)
    try:
        values["settings"] = _runtime_layers(values, assignments)
        config = AgentConfig.model_validate(values)
    except runtime.SettingsError as error:
        raise ConfigError(f"{source}: {error}") from None
    except ValidationError as error:
        raise ConfigError(_one_line(error, source)) from None
    token = _read_token(config)
    if not config.is_loopback and token is None:
        raise ConfigError(
            f"refusing to listen on {config.host} without a token: anyone who can reach it could "
            "drive the pool; set --token-file FILE or KVCTL_TOKEN, or bind 127.0.0.1"
        )
    public = config.kv_events_public()
    if public and token is None:
        raise ConfigError(
            f"refusing to publish KV events on {public[0]} without a token: they carry the "
            "tokens of every cached prompt; set --token-file FILE or KVCTL_TOKEN, or bind "
            "tcp://127.0.0.1:PORT"
        )
    return config.model_copy(update={"token": token})
