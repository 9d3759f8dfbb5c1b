"""`kvctl config show|set`: the agent's runtime settings (defrag, resize, prefix cache, alerts).

`set` takes `SECTION.KEY=VALUE` pairs (`defrag.fragmentation_threshold=0.4`); values are read as
JSON when they parse (numbers, true/false, null) and as text otherwise. The agent checks them
and refuses a bad one with its reason, changing nothing.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from kvctl.cli.options import (
    AgentOption,
    ExitCode,
    JsonOption,
    TimeoutOption,
    TokenOption,
    YesOption,
    fail,
    resolve,
)
from kvctl.cli.output import confirm, finish, on_each

if TYPE_CHECKING:
    from kvctl.api import RuntimeSettings, RuntimeSettingsPatch

SECTIONS = ("defrag", "resize", "prefix_cache", "alerts", "rebalance", "chat", "sleep")
"""The sections of RuntimeSettings (a test keeps them equal; pydantic loads only when used)."""

config_app = typer.Typer(
    help="Show or change the agent's runtime settings.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


@config_app.command("show")
def show(
    ctx: typer.Context,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Show the settings the agent runs with now."""
    target = resolve(ctx, agent, token, json_out, timeout)
    finish(target, on_each(target, lambda client: client.config()), settings_table)


@config_app.command("set")
def set_values(
    ctx: typer.Context,
    pairs: Annotated[list[str], typer.Argument(metavar="SECTION.KEY=VALUE...", show_default=False)],
    yes: YesOption = False,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Change settings, e.g. `defrag.fragmentation_threshold=0.4 resize.enabled=true`."""
    target = resolve(ctx, agent, token, json_out, timeout)
    patch = parse_pairs(pairs)
    if target.fleet:
        confirm(f"Change the settings of {len(target.agents)} agents?", yes)
    finish(target, on_each(target, lambda client: client.patch_config(patch)), settings_table)


def parse_pairs(pairs: list[str]) -> RuntimeSettingsPatch:
    """`SECTION.KEY=VALUE` pairs as a PATCH body; a malformed pair is a usage error."""
    from kvctl.api import RuntimeSettingsPatch

    sections: dict[str, dict[str, Any]] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        section, dot, field = key.strip().partition(".")
        if not (sep and dot and field) or section not in SECTIONS:
            fail(
                f"cannot read {pair!r}; write SECTION.KEY=VALUE with SECTION one of "
                f"{', '.join(SECTIONS)}, e.g. defrag.fragmentation_threshold=0.4",
                ExitCode.USAGE,
            )
        sections.setdefault(section, {})[field] = _value(raw.strip())
    return RuntimeSettingsPatch(**sections)


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def settings_table(settings: RuntimeSettings) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("setting", style="bold")
    table.add_column("value")
    for section in SECTIONS:
        for key, value in getattr(settings, section).model_dump(mode="json").items():
            table.add_row(Text(f"{section}.{key}"), Text(json.dumps(value)))
    return table
