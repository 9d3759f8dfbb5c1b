"""What reads the section models: the table of settings, the start-up limits, strict
validation of changes, the text and TOML readers, and docs/settings.md."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from pydantic import ValidationError

from kvctl.settings.sections import SECTIONS, RuntimeSettings, SettingsError
from kvctl.units import parse_duration

# ---- the table of settings --------------------------------------------------------------------


SettingKind = Literal["bool", "int", "float", "choice"]
_KINDS: dict[object, SettingKind] = {bool: "bool", int: "int", float: "float"}


@dataclass(frozen=True)
class SettingSpec:
    """One setting as the docs, the CLI and the error messages describe it."""

    key: str  # "section.name"
    kind: SettingKind
    default: Any
    ge: float | None
    le: float | None
    unit: str
    help: str
    flag: str | None
    choices: tuple[str, ...] = ()
    nullable: bool = False

    @property
    def section(self) -> str:
        return self.key.partition(".")[0]

    @property
    def name(self) -> str:
        return self.key.partition(".")[2]

    def allowed(self) -> str:
        """What the setting accepts, in words: "a number of seconds in [1, 3600]"."""
        if self.kind == "bool":
            return "true or false"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        noun = "a whole number" if self.kind == "int" else "a number"
        unit = f" of {self.unit}" if self.unit in ("seconds", "pages", "extents") else ""
        text = f"{noun}{unit} in [{_number(self.ge)}, {_number(self.le)}]"
        if self.unit == "per minute":
            text += " per minute"
        return text + (", or null for the default" if self.nullable else "")

    def parse_text(self, text: str) -> Any:
        """The value of `text` as written on a command line or in a TOML string: booleans as
        true/false, durations with units ("15s"), `null` for the default."""
        raw = text.strip()
        if raw.lower() in ("null", "none", "default"):
            return None
        if self.kind == "bool":
            lowered = raw.lower()
            if lowered not in ("true", "false"):
                raise SettingsError(self.key, f"must be {self.allowed()}, got {text!r}")
            return lowered == "true"
        if self.kind == "choice":
            return raw
        if self.unit == "seconds":
            try:
                return parse_duration(raw)
            except ValueError:
                raise SettingsError(self.key, f"must be {self.allowed()}, got {text!r}") from None
        try:
            return int(raw) if self.kind == "int" else float(raw)
        except ValueError:
            raise SettingsError(self.key, f"must be {self.allowed()}, got {text!r}") from None


def _number(value: float | None) -> str:
    if value is None:
        return "∞"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _spec(section: str, name: str, field: Any) -> SettingSpec:
    annotation = field.annotation
    nullable = False
    if get_origin(annotation) is not None and type(None) in get_args(annotation):
        nullable = True
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    choices: tuple[str, ...] = ()
    kind: SettingKind
    if get_origin(annotation) is Literal:
        kind, choices = "choice", tuple(get_args(annotation))
    else:
        kind = _KINDS[annotation]
    ge = le = None
    for constraint in field.metadata:
        ge = getattr(constraint, "ge", ge)
        le = getattr(constraint, "le", le)
    extra = field.json_schema_extra or {}
    return SettingSpec(
        key=f"{section}.{name}",
        kind=kind,
        default=field.default,
        ge=ge,
        le=le,
        unit=extra.get("unit", ""),
        help=field.description or "",
        flag=extra.get("flag"),
        choices=choices,
        nullable=nullable,
    )


SPECS: dict[str, SettingSpec] = {
    spec.key: spec
    for section, model in SECTIONS.items()
    for name, field in model.model_fields.items()
    for spec in [_spec(section, name, field)]
}
"""Every setting by `section.name`, in the order of the models."""

FLAGS: dict[str, SettingSpec] = {spec.flag: spec for spec in SPECS.values() if spec.flag}
"""The settings that also have a `kvctl-agent` flag, by flag (`--alert-interval`)."""


# ---- limits fixed at start-up -----------------------------------------------------------------


@dataclass(frozen=True)
class StartupLimits:
    """What the agent was started with and no runtime setting may exceed."""

    segment_pages: int
    max_pool_pages: int

    def defaults(self, base: RuntimeSettings | None = None) -> RuntimeSettings:
        """`base` (the built-in defaults when None) with the start-up dependent defaults filled
        in: the values `null` restores and `GET` shows."""
        base = base or RuntimeSettings()
        resize = base.resize.model_copy(
            update={
                "min_pages": base.resize.min_pages or self.segment_pages,
                "max_pages": base.resize.max_pages or self.max_pool_pages,
            }
        )
        return base.model_copy(update={"resize": resize})

    def check(self, settings: RuntimeSettings) -> RuntimeSettings:
        """`settings` if they respect the start-up limits; SettingsError names the key."""
        resize = settings.resize
        if resize.max_pages is not None and resize.max_pages > self.max_pool_pages:
            raise SettingsError(
                "resize.max_pages",
                f"must be at most {self.max_pool_pages}, the --max-pool-pages the agent was "
                "started with (restart with a larger one to allow more)",
            )
        if resize.max_pages is not None and resize.max_pages < self.segment_pages:
            raise SettingsError(
                "resize.max_pages", f"must be at least one segment ({self.segment_pages} pages)"
            )
        if resize.min_pages is not None and resize.min_pages > self.max_pool_pages:
            raise SettingsError(
                "resize.min_pages",
                f"must be at most {self.max_pool_pages}, the --max-pool-pages the agent was "
                "started with",
            )
        return settings


# ---- validating and changing ------------------------------------------------------------------


def validate(values: Mapping[str, Any]) -> RuntimeSettings:
    """Settings from nested `{section: {name: value}}`; SettingsError names the first bad key."""
    _check_keys(values)
    try:
        return RuntimeSettings.model_validate(values)
    except SettingsError:
        raise
    except ValidationError as error:
        raise _one_error(error, values) from None


def apply_changes(
    current: RuntimeSettings,
    changes: Any,
    defaults: RuntimeSettings,
    limits: StartupLimits | None = None,
) -> RuntimeSettings:
    """`current` with `changes` (`{section: {name: value}}`, a PATCH body) applied; `null`
    restores `defaults`' value. Raises SettingsError, and then nothing has changed."""
    _check_keys(changes)
    merged = current.model_dump()
    for section, values in changes.items():
        for name, value in values.items():
            if value is None:
                value = getattr(getattr(defaults, section), name)
            merged[section][name] = value
    settings = validate(merged)
    return limits.check(settings) if limits is not None else settings


def _check_keys(changes: Any) -> None:
    if not isinstance(changes, Mapping):
        raise SettingsError("body", 'must be an object of sections, e.g. {"defrag": {...}}')
    for section, values in changes.items():
        if section not in SECTIONS:
            raise SettingsError(
                str(section), f"unknown section; the sections are {', '.join(SECTIONS)}"
            )
        if not isinstance(values, Mapping):
            raise SettingsError(section, "must be an object of settings")
        for name in values:
            if f"{section}.{name}" not in SPECS:
                known = ", ".join(SECTIONS[section].model_fields)
                raise SettingsError(f"{section}.{name}", f"unknown setting; {section} has {known}")


def _one_error(error: ValidationError, values: Mapping[str, Any]) -> SettingsError:
    first = error.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, SettingsError):
        return cause
    location = [str(part) for part in first["loc"]]
    key = ".".join(location[:2])
    spec = SPECS.get(key)
    if spec is None:
        return SettingsError(key or "settings", first["msg"].removeprefix("Value error, "))
    given = values.get(spec.section, {}).get(spec.name) if isinstance(values, Mapping) else None
    return SettingsError(key, f"must be {spec.allowed()}, got {json.dumps(given, default=str)}")


def from_text(assignments: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """`{"section.name": "text"}` (from `--set` and named flags) as nested changes, each value
    read by its setting's type; SettingsError for an unknown key or unreadable value."""
    changes: dict[str, dict[str, Any]] = {}
    for key, text in assignments.items():
        spec = SPECS.get(key)
        if spec is None:
            raise SettingsError(key, f"unknown setting; see {DOCS_PATH} for the valid ones")
        changes.setdefault(spec.section, {})[spec.name] = spec.parse_text(text)
    return changes


def from_toml(tables: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The `[section]` tables of a TOML file as nested changes: durations may be written with
    units ("15s"); every other value must already have its setting's type."""
    _check_keys(tables)
    changes: dict[str, dict[str, Any]] = {}
    for section, values in tables.items():
        for name, value in values.items():
            spec = SPECS[f"{section}.{name}"]
            if isinstance(value, str) and spec.kind != "choice":
                value = spec.parse_text(value)
            changes.setdefault(section, {})[name] = value
    return changes


def merge(*layers: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Nested changes, later layers winning key by key."""
    merged: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for section, values in layer.items():
            merged.setdefault(section, {}).update(values)
    return merged


# ---- docs ---------------------------------------------------------------------------------------

DOCS_PATH = "docs/settings.md"


def _rows() -> Iterator[str]:
    for spec in SPECS.values():
        default = "start-up" if spec.default is None else json.dumps(spec.default)
        flag = f"`{spec.flag}`" if spec.flag else ""
        yield f"| `{spec.key}` | {spec.allowed()} | `{default}` | {flag} | {spec.help} |"


def render_markdown() -> str:
    """docs/settings.md: every runtime setting with its type, range, default and flag."""
    return "\n".join(
        [
            "# Runtime settings",
            "",
            "<!-- Generated by `python -m kvctl.agent.startup.settings_docs`; a test keeps it "
            "equal. -->",
            "",
            "Every setting below can be read with `GET /v1/config` (`kvctl config show`) and",
            "changed while the agent runs with `PATCH /v1/config` (`kvctl config set KEY=VALUE`),",
            "set at start-up with `kvctl-agent --set KEY=VALUE` (or the flag named in the table),",
            "or written in the TOML file as a table per section:",
            "",
            "```toml",
            "[defrag]",
            "fragmentation_threshold = 0.4",
            'check_interval_s = "2s"   # seconds may be written with units in TOML and --set',
            "```",
            "",
            "Values are checked strictly: a boolean is not a number, an integer setting refuses",
            "`2.0`, numbers must be finite and in range, and unknown keys are refused. A refused",
            "change answers 422 naming the key and what it accepts, and changes nothing. `null`",
            "restores the default; `resize.min_pages` and `resize.max_pages` default to one",
            "segment and to `--max-pool-pages`, and `GET` shows the values in force.",
            "",
            "| setting | accepts | default | flag | what it does |",
            "|---|---|---|---|---|",
            *_rows(),
            "",
        ]
    )
