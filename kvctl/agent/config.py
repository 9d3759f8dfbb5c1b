"""The agent's start-up configuration: command-line flags over an optional TOML file.

Every flag of `kvctl-agent` is also a key of the TOML file (`--page-size` is `page_size`); a flag
given on the command line wins. Unknown keys, bad values and contradictory choices (two ways of
sizing the pool, a public address without a token) are refused before anything starts, with one
line that names the key and what to write instead.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvctl.api import DEFAULT_PORT, MAX_COMPLETION_TOKENS
from kvctl.units import parse_duration, parse_size


class ConfigError(ValueError):
    """A configuration the agent refuses to start with; the message is one line."""


class AgentConfig(BaseModel):
    """What `kvctl-agent` runs with (flags and TOML keys have the same names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = DEFAULT_PORT
    model: str = "demo"
    device: str = "cpu"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    page_size: Annotated[int, Field(ge=1, le=4096)] = 16
    pool_pages: Annotated[int, Field(ge=1)] | None = None
    pool_memory: int | None = None  # bytes; "2GiB" accepted
    gpu_memory_fraction: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    segment_pages: Annotated[int, Field(ge=1)] | None = None
    max_pool_pages: Annotated[int, Field(ge=1)] | None = None
    prefix_cache: bool = True
    prefix_isolation: Literal["salt", "sampling"] = "salt"
    eviction_policy: Literal["lru", "lfu", "fifo"] = "lru"
    max_batch_seqs: Annotated[int, Field(ge=1, le=4096)] = 64
    torch_threads: Annotated[int, Field(ge=1, le=1024)] | None = None  # default: cores - 1
    max_batch_tokens: Annotated[int, Field(ge=1)] = 4096
    max_tokens_limit: Annotated[int, Field(ge=1, le=MAX_COMPLETION_TOKENS)] = 1024
    max_prompt_tokens: Annotated[int, Field(ge=1)] = 8192
    max_body_bytes: Annotated[int, Field(ge=1024)] = 1 << 20
    token_file: Path | None = None
    alertmanager_url: str | None = None
    alertmanager_bearer_token_file: Path | None = None
    alertmanager_basic_auth_user: str | None = None
    alertmanager_basic_auth_password_file: Path | None = None
    alertmanager_ca_file: Path | None = None
    alert_interval: float = 15.0  # seconds; "15s" accepted
    alert_for: float = 60.0
    stats_window: float = 300.0  # the window of the success and hit ratios; "5m" accepted
    shutdown_grace: float = 10.0
    seed: int = 0
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    token: str | None = Field(default=None, exclude=True, repr=False)  # read from token_file/env

    @field_validator("pool_memory", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)

    @field_validator("alert_interval", "alert_for", "shutdown_grace", "stats_window", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return parse_duration(value)

    @field_validator("alert_interval", "stats_window")
    @classmethod
    def _positive_interval(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be a positive duration such as 15s")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value != "cpu" and not value.startswith("cuda"):
            raise ValueError("must be cpu, cuda or cuda:N")
        return value

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
        if self.alertmanager_bearer_token_file and self.alertmanager_basic_auth_user:
            raise ValueError("give Alertmanager a bearer token or basic auth, not both")
        if bool(self.alertmanager_basic_auth_user) != bool(
            self.alertmanager_basic_auth_password_file
        ):
            raise ValueError(
                "alertmanager_basic_auth_user and alertmanager_basic_auth_password_file go together"
            )
        return self

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    return {key.replace("-", "_"): value for key, value in data.items()}


def _read_token(config: AgentConfig) -> str | None:
    if config.token_file is not None:
        try:
            token = config.token_file.read_text().strip()
        except OSError as error:
            raise ConfigError(
                f"cannot read --token-file {config.token_file}: {error.strerror}"
            ) from None
        if not token:
            raise ConfigError(f"--token-file {config.token_file} is empty")
        return token
    return os.environ.get("KVCTL_TOKEN") or None


def _one_line(error: ValidationError, source: str) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "config"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown setting; see `kvctl-agent --help` for the valid ones"
    return f"{source}: {where}: {message}"


def load_config(flags: dict[str, Any], config_file: Path | None = None) -> AgentConfig:
    """The configuration from `flags` (None means not given) over the TOML file's values."""
    values: dict[str, Any] = _read_toml(config_file) if config_file else {}
    values.update({k: v for k, v in flags.items() if v is not None})
    source = f"config {config_file}" if config_file else "kvctl-agent"
    try:
        config = AgentConfig.model_validate(values)
    except ValidationError as error:
        raise ConfigError(_one_line(error, source)) from None
    token = _read_token(config)
    if not config.is_loopback and token is None:
        raise ConfigError(
            f"refusing to listen on {config.host} without a token: anyone who can reach it could "
            "drive the pool; set --token-file FILE or KVCTL_TOKEN, or bind 127.0.0.1"
        )
    return config.model_copy(update={"token": token})
