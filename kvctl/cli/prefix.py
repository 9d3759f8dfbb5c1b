"""`kvctl prefix lookup|pin|unpin|ls|clear`: what an agent's prefix cache holds of a prompt, and
keeping a prefix warm or purging one.

A prompt is given as text (the argument, or `--file`, `-` for standard input), as a chat
(`--chat FILE`: a JSON list of `{"role", "content"}` messages, rendered with the model's template
as a conversation starts) or as token ids (`--token-ids 1,2,3`), in the partition of
`--salt` (the requests' `cache_salt`). `clear` asks first (skip with --yes): what it forgets must
be computed again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import BaseModel
from rich.console import RenderableType

from kvctl.cli.levers import as_json, pull_outcome, render_result
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
from kvctl.cli.output import confirm, finish, on_agent, on_each
from kvctl.view import prefixes

if TYPE_CHECKING:
    from kvctl.client import AgentClient

Q = TypeVar("Q", bound=BaseModel)

prefix_app = typer.Typer(
    help="Look up, pin, list and clear cached prompt prefixes.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)

TextArgument = Annotated[
    str | None, typer.Argument(help="The prompt's text (or give --file, --chat or --token-ids).")
]
FileOption = Annotated[
    Path | None,
    typer.Option("--file", "-f", help="Read the prompt's text from FILE (- for stdin)."),
]
ChatOption = Annotated[
    Path | None,
    typer.Option(
        "--chat",
        help="A JSON file of chat messages, rendered with the model's template (- for stdin).",
    ),
]
TokenIdsOption = Annotated[
    str | None, typer.Option("--token-ids", help="The prompt as token ids: 1,2,3.")
]
SaltOption = Annotated[
    str | None, typer.Option("--salt", help="The cache salt (tenant) whose partition to use.")
]
ModelOption = Annotated[
    str | None,
    typer.Option("--model", "-m", help="The model (required when the agent serves several)."),
]


def _read(path: Path) -> str:
    try:
        return sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        fail(f"cannot read {path}: {error}", ExitCode.USAGE)


def _messages(path: Path) -> list[Any]:
    try:
        messages = json.loads(_read(path))
    except json.JSONDecodeError as error:
        fail(f"--chat {path}: not JSON ({error.msg} at line {error.lineno})", ExitCode.USAGE)
    if not isinstance(messages, list) or not messages:
        fail(f"--chat {path}: expected a JSON list of messages", ExitCode.USAGE)
    return messages


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        fail(f"--token-ids {text!r}: write integers separated by commas", ExitCode.USAGE)
    if not ids or min(ids) < 0:
        fail("--token-ids: give at least one token id, none negative", ExitCode.USAGE)
    return ids


def prompt_fields(
    text: str | None, file: Path | None, chat: Path | None, token_ids: str | None
) -> dict[str, Any]:
    """The query's prompt fields from exactly one of the four forms."""
    given = [form for form in (text, file, chat, token_ids) if form is not None]
    if len(given) != 1:
        fail("give the prompt once: as text, --file, --chat or --token-ids", ExitCode.USAGE)
    if text is not None:
        return {"prompt": text}
    if file is not None:
        return {"prompt": _read(file)}
    if chat is not None:
        return {"messages": _messages(chat)}
    assert token_ids is not None
    return {"token_ids": _token_ids(token_ids)}


def _query(model_type: type[Q], **fields: Any) -> Q:
    """The request body, checked here as the agent checks it (JSON, strict)."""
    from pydantic import ValidationError

    try:
        return model_type.model_validate_json(json.dumps(fields))
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        fail(f"{where or 'prompt'}: {first['msg']}", ExitCode.USAGE)


@prefix_app.command("lookup")
def lookup(
    ctx: typer.Context,
    text: TextArgument = None,
    file: FileOption = None,
    chat: ChatOption = None,
    token_ids: TokenIdsOption = None,
    salt: SaltOption = None,
    model: ModelOption = None,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """How much of a prompt is cached, on the device and in each tier, and which pins hold it."""
    from kvctl.api import PrefixQuery

    target = resolve(ctx, agent, token, json_out, timeout)
    fields = prompt_fields(text, file, chat, token_ids)
    query = _query(PrefixQuery, model=model, cache_salt=salt, **fields)

    def ask(client: AgentClient) -> Any:
        return client.prefix_lookup(query)

    finish(target, on_each(target, ask), prefixes.lookup_result)


@prefix_app.command("pin")
def pin(
    ctx: typer.Context,
    text: TextArgument = None,
    file: FileOption = None,
    chat: ChatOption = None,
    token_ids: TokenIdsOption = None,
    salt: SaltOption = None,
    model: ModelOption = None,
    ttl: Annotated[
        str | None,
        typer.Option("--ttl", help="Unpin by itself after this long (30m, 2h); default never."),
    ] = None,
    warm: Annotated[
        bool,
        typer.Option("--warm", help="Compute the prompt first if it is not cached whole."),
    ] = False,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Keep the cached part of a prompt on the device through any eviction.

    Pins hold whole pages, at most `prefix_cache.max_pinned_share` of the pool; past it the pin
    is refused with the reason. Only what is cached can be pinned: send the prompt once first,
    or give --warm to have the agent compute it.
    """
    from kvctl.api import PrefixPinRequest
    from kvctl.units import parse_duration

    target = resolve(ctx, agent, token, json_out, timeout)
    ttl_s = None
    if ttl is not None:
        try:
            ttl_s = parse_duration(ttl)
        except ValueError as error:
            fail(f"--ttl: {error}", ExitCode.USAGE)
    fields = prompt_fields(text, file, chat, token_ids)
    request = _query(
        PrefixPinRequest, model=model, cache_salt=salt, ttl_s=ttl_s, warm=warm, **fields
    )

    def do_pin(client: AgentClient) -> Any:
        return client.prefix_pin(request)

    finish(target, on_each(target, do_pin), prefixes.pin_result)


@prefix_app.command("move")
def move(
    ctx: typer.Context,
    to: Annotated[str, typer.Option("--to", help="device (prefetch) or host (store a copy).")],
    text: TextArgument = None,
    file: FileOption = None,
    chat: ChatOption = None,
    token_ids: TokenIdsOption = None,
    salt: SaltOption = None,
    model: ModelOption = None,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Bring a prompt's prefix to the device before a known burst (`--to device`: computed, or
    loaded from the tier that holds it), or store a copy of the device's pages in the host tier
    (`--to host`). Prints the lookup after it."""
    from kvctl.api import PrefixMoveRequest

    if to not in ("device", "host", "disk"):
        fail(f"--to {to!r}: choose device or host", ExitCode.USAGE)
    target = resolve(ctx, agent, token, json_out, timeout)
    fields = prompt_fields(text, file, chat, token_ids)
    request = _query(PrefixMoveRequest, model=model, cache_salt=salt, to=to, **fields)

    def do_move(client: AgentClient) -> Any:
        return client.prefix_move(request)

    finish(target, on_each(target, do_move), prefixes.lookup_result)


@prefix_app.command("unpin")
def unpin(
    ctx: typer.Context,
    pin_id: Annotated[str, typer.Argument(help="The pin's id (kvctl prefix ls).")],
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Let a pin go: its pages stay cached, and may be evicted again."""
    target = resolve(ctx, agent, token, json_out, timeout)

    def do_unpin(client: AgentClient) -> Any:
        return client.prefix_unpin(pin_id)

    finish(target, on_each(target, do_unpin), prefixes.unpin_result)


@prefix_app.command("ls")
def ls(
    ctx: typer.Context,
    model: ModelOption = None,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """The pins, and the largest cached prefixes, of every model or one."""
    target = resolve(ctx, agent, token, json_out, timeout)

    def listing(client: AgentClient) -> Any:
        return client.prefix_listing(model)

    finish(target, on_each(target, listing), prefixes.listing)


@prefix_app.command("clear")
def clear(
    ctx: typer.Context,
    model: ModelOption = None,
    salt: SaltOption = None,
    tier: Annotated[
        str,
        typer.Option("--tier", help="Where to clear: device, host, disk or all."),
    ] = "all",
    yes: YesOption = False,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Forget cached prefixes and their pins: every model or one, every salt or one, in every
    place or one. A purge: nothing moves down a tier. Asks first (skip with --yes).

    On an engine's server (`--agent vllm+http://...`, `sglang+http://...`) it pulls the engine's
    own reset, which forgets its whole prefix cache (vLLM needs VLLM_SERVER_DEV_MODE=1).
    """
    from kvctl.api import PrefixClearRequest
    from kvctl.engine_levers import PREFIX_CLEAR, LeverResult, engine_target

    if tier not in ("all", "device", "host", "disk"):
        fail(f"--tier {tier!r}: choose device, host, disk or all", ExitCode.USAGE)
    target = resolve(ctx, agent, token, json_out, timeout)
    engines = [a for a in target.agents if engine_target(a)[0] is not None]
    if engines and (model is not None or salt is not None or tier != "all"):
        fail(
            f"{engines[0]}: an engine's reset forgets its whole prefix cache; --model, --salt "
            "and --tier choose what kvctl agents forget",
            ExitCode.USAGE,
        )
    scope = f"{'model ' + model if model else 'every model'}, " + (
        f"cache salt {salt!r}" if salt is not None else "every cache salt"
    )
    places = "every place" if tier == "all" else f"the {tier}"
    agents = f" on {len(target.agents)} agents" if target.fleet else ""
    confirm(f"Forget the cached prefixes of {scope}, in {places}{agents}?", yes)
    request = PrefixClearRequest.model_validate({"model": model, "cache_salt": salt, "tier": tier})

    def do_clear(client: AgentClient) -> Any:
        return client.prefix_clear(request)

    outcomes = [
        pull_outcome(target, a, PREFIX_CLEAR) if a in engines else on_agent(target, a, do_clear)
        for a in target.agents
    ]

    def show(result: Any) -> RenderableType:
        if isinstance(result, LeverResult):
            return render_result(result)
        return prefixes.clear_result(result)

    finish(target, outcomes, show, as_json)
