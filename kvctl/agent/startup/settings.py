"""The start-up settings' table, read from their one definition (the fields of `AgentConfig`).

Everything that names a start-up setting is built here from its field: the options of
`kvctl-agent` (type, flag names, help with the default), the keys the TOML file accepts
(`kvctl.agent.config.toml_keys`) and the "Start-up settings" part of docs/settings.md (written,
with the runtime settings, by `python -m kvctl.agent.startup.settings_docs`). The runtime
settings' named flags (`--eviction-policy`, ...) come from their own definition in
kvctl.settings.

No torch here: `kvctl-agent --help` and the docs generator import it.
"""

from __future__ import annotations

import inspect
import json
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import typer
from pydantic.fields import FieldInfo

from kvctl import settings as runtime
from kvctl.agent.config import (
    FLAG_KEYS,
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_MODELS,
    AgentConfig,
    ModelSpec,
    startup_extra,
)

CliType = type[str] | type[int] | type[float] | type[bool] | type[Path]


@dataclass(frozen=True)
class StartupSpec:
    """One start-up setting as the CLI, the TOML file and the docs describe it."""

    key: str  # the TOML key and the AgentConfig field: "page_size"
    flags: tuple[str, ...]  # "--page-size" (and former names); () for a file-only key
    cli_type: CliType  # what the flag takes: sizes and durations are text ("2GiB", "5m")
    repeatable: bool
    default: Any  # the field's default (None: not given; resolved when the pool is sized)
    default_text: str  # the default as the help and the docs show it
    help: str
    accepts: str  # what the key accepts, in words
    metavar: str | None = None  # what the flag's value is, as the help names it: SIZE, N

    @property
    def flag(self) -> str | None:
        return self.flags[0] if self.flags else None

    def option_help(self) -> str:
        """The flag's help: the definition's help with the default."""
        return f"{self.help.removesuffix('.')} (default {self.default_text})."

    def option_declarations(self) -> tuple[str, ...]:
        if self.cli_type is bool:
            return (f"{self.flags[0]}/--no-{self.flags[0].removeprefix('--')}",)
        return self.flags

    def parameter(self) -> inspect.Parameter:
        """The command's parameter for this flag: not given (None) unless on the command line,
        so that a TOML value is not overridden by a default."""
        base: Any = list[str] if self.repeatable else self.cli_type  # lists are of text
        option = typer.Option(
            *self.option_declarations(), help=self.option_help(), metavar=self.metavar
        )
        return inspect.Parameter(
            self.key,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[base | None, option],
        )


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the type without None and Annotated, whether None was allowed)."""
    nullable = False
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(get_args(annotation))
        annotation = args[0]
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation, nullable


def _range(field: FieldInfo) -> str:
    low = high = None
    low_word = "["
    for constraint in [*field.metadata, *_inner_metadata(field.annotation)]:
        if getattr(constraint, "ge", None) is not None:
            low = constraint.ge
        if getattr(constraint, "gt", None) is not None:
            low, low_word = constraint.gt, "("
        if getattr(constraint, "le", None) is not None:
            high = constraint.le
    if low is None and high is None:
        return ""
    return f" in {low_word}{_number(low)}, {_number(high)}]"


def _inner_metadata(annotation: Any) -> list[Any]:
    """The constraints of `Annotated[int, Field(ge=1)] | None` (pydantic keeps them inside)."""
    if get_origin(annotation) not in (Union, types.UnionType):
        return []
    found: list[Any] = []
    for arg in get_args(annotation):
        if get_origin(arg) is Annotated:
            for info in get_args(arg)[1:]:
                found += getattr(info, "metadata", [])
    return found


def _number(value: float | None) -> str:
    if value is None:
        return "∞"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def format_size(count: int) -> str:
    """Bytes as a flag takes them: 10737418240 -> "10GiB", 0 -> "0"."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if count and count % (1 << shift) == 0:
            return f"{count >> shift}{unit}"
    return str(count)


def format_duration(seconds: float) -> str:
    """Seconds as a flag takes them: 300 -> "5m", 10 -> "10s", 0.5 -> "500ms"."""
    for size, unit in ((3600, "h"), (60, "m"), (1, "s")):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds * 1000:g}ms"


def _default_text(value: Any, unit: str) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "none"
    if unit == "bytes":
        return format_size(value)
    if unit == "seconds":
        return format_duration(value)
    return str(value)


def _accepts(kind: Any, field: FieldInfo, unit: str, repeatable: bool) -> str:
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(str(choice) for choice in get_args(kind))
    if unit == "bytes":
        return 'bytes, e.g. "2GiB" or 2147483648'
    if unit == "seconds":
        return f'a duration, e.g. "15s"{_range(field)}'
    if repeatable:
        return "a list of tables" if kind is ModelSpec else "a list of strings"
    words = {bool: "true or false", int: "a whole number", float: "a number", Path: "a path"}
    return words.get(kind, "a string") + (_range(field) if kind in (int, float) else "")


def _spec(key: str, field: FieldInfo, extra: dict[str, Any]) -> StartupSpec:
    kind, _ = _unwrap(field.annotation)
    repeatable = get_origin(kind) is list
    item = get_args(kind)[0] if repeatable else kind
    unit = extra["unit"]
    # sizes, durations and choices are text, read by the field's validator ("2GiB", "5m")
    text = unit or get_origin(item) is Literal or item is ModelSpec
    cli_type: CliType = str if text else item
    flags: tuple[str, ...] = ()
    if extra["flag"]:
        flags = tuple(f"--{name.replace('_', '-')}" for name in (key, *extra["aliases"]))
    return StartupSpec(
        key=key,
        flags=flags,
        cli_type=cli_type,
        repeatable=repeatable,
        default=field.default,
        default_text=extra.get("default_text") or _default_text(field.default, unit),
        help=field.description or "",
        accepts=_accepts(item, field, unit, repeatable),
        metavar=_metavar(key, item, unit),
    )


NAMED_VALUES = {"model": "[NAME=]PATH", "served_model_name": "NAME", "host": "ADDRESS"}
"""Values the help names better than their type does."""


def _metavar(key: str, kind: Any, unit: str) -> str | None:
    """The flag's value in one word, as the help shows it after the flag (None: a switch)."""
    if kind is bool:
        return None
    if key in NAMED_VALUES:
        return NAMED_VALUES[key]
    if key.endswith(("_url", "_endpoint")):
        return key.rpartition("_")[2].upper()
    if unit:
        return {"bytes": "SIZE", "seconds": "DURATION"}.get(unit, unit.upper())
    if get_origin(kind) is Literal:
        return "|".join(str(choice) for choice in get_args(kind))
    named = {ModelSpec: "MODEL", Path: "PATH", int: "N", float: "NUMBER"}
    return named.get(kind, "TEXT")


SPECS: dict[str, StartupSpec] = {
    key: _spec(key, field, extra)
    for key, field in AgentConfig.model_fields.items()
    for extra in [startup_extra(field)]
    if extra is not None
}
"""Every start-up setting by key, in the order of AgentConfig's fields."""

FLAGS: dict[str, StartupSpec] = {flag: spec for spec in SPECS.values() for flag in spec.flags}
"""The start-up settings with a flag, by each of its flag names."""


def runtime_flag_help(flag: str) -> str:
    """A runtime setting's flag help, from its one definition in kvctl.settings."""
    spec = runtime.FLAGS[flag]
    return f"{spec.help} Sets {spec.key} (default {spec.default})."


def runtime_flag_parameters() -> Iterator[inspect.Parameter]:
    """The runtime settings that have a flag of their own (`--alert-interval`): text, read by
    the setting's type."""
    for key, spec in FLAG_KEYS.items():
        assert spec.flag is not None  # FLAG_KEYS holds only the settings with a flag
        metavar = "|".join(spec.choices) or _metavar(key, str, spec.unit)
        option = typer.Option(spec.flag, help=runtime_flag_help(spec.flag), metavar=metavar)
        yield inspect.Parameter(
            key,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[str | None, option],
        )


def setting_parameters() -> list[inspect.Parameter]:
    """Every flag of a setting, start-up settings first, each given as None when absent."""
    startup = [spec.parameter() for spec in SPECS.values() if spec.flags]
    return [*startup, *runtime_flag_parameters()]


# ---- docs ---------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _rows() -> Iterator[str]:
    for spec in SPECS.values():
        flag = ", ".join(f"`{f}`" for f in spec.flags) if spec.flags else "file only"
        if spec.cli_type is bool and spec.flags:
            flag = f"`{spec.flags[0]}`, `--no-{spec.flags[0].removeprefix('--')}`"
        yield (
            f"| `{spec.key}` | {flag} | {_cell(spec.accepts)} | {_cell(spec.default_text)} "
            f"| {_cell(spec.help)} |"
        )


def _model_rows() -> Iterator[str]:
    for key, field in ModelSpec.model_fields.items():
        default = "none" if field.default in (None, []) else json.dumps(field.default)
        yield f"| `{key}` | {default} | {_cell(field.description or '')} |"


def render_startup_markdown() -> str:
    """The "Start-up settings" part of docs/settings.md."""
    aliases = ", ".join(
        f"`{old}` (`{spec.flags[1] if len(spec.flags) > 1 else old}`) for `{spec.key}`"
        for spec in SPECS.values()
        for old in (f.removeprefix("--").replace("-", "_") for f in spec.flags[1:])
    )
    return "\n".join(
        [
            "# Start-up settings",
            "",
            "Fixed while the agent runs: give them as flags of `kvctl-agent` or as keys of the",
            "TOML file named by `--config` (a flag given on the command line wins). A key is its",
            "flag without the dashes, `_` for `-` (`--page-size` is `page_size`); a few are",
            "file-only. The TOML file also takes the runtime settings above, as `[section]`",
            "tables or by the flat key of their flag (`alert_interval`). Sizes may be written",
            'with units ("2GiB") and durations too ("5m"). Unknown keys, bad values and',
            "contradictory choices are refused before anything starts, with one line naming the",
            f"key. Former names: {aliases}.",
            "",
            "The file (and `token_file`) must be a regular file of at most "
            f"{format_size(MAX_CONFIG_BYTES)} of UTF-8",
            "text: a directory, FIFO, device or socket is refused before it is read, and so is",
            f"a file nested more than {MAX_CONFIG_DEPTH} levels deep (arrays, inline tables and "
            "the parts of",
            "dotted keys).",
            "",
            "| key | flag | accepts | default | what it does |",
            "|---|---|---|---|---|",
            *_rows(),
            "",
            "## `[[models]]` tables",
            "",
            "Each table is one model with a pool of its own (instead of `--model` flags); sizes",
            "left out come from the top-level keys, then from an equal share of `kv_budget`.",
            f"One agent serves at most {MAX_MODELS} models (tables or `--model` flags).",
            "",
            "| key | default | what it is |",
            "|---|---|---|",
            *_model_rows(),
            "",
        ]
    )


def render_settings_docs() -> str:
    """docs/settings.md: the runtime settings, then the start-up settings."""
    return runtime.render_markdown() + "\n" + render_startup_markdown()
