"""`kvctl sleep` and `kvctl wake`: sleep and wake a kvctl agent's models, or pull another
engine's sleep and wake levers.

On a kvctl agent they name a model (`--model`, or the agent's only one): a sleep releases its KV
pool to the agent's budget (level 2 drops its weights too), a wake or its next request brings
them back (`kvctl.agent.model_sleep`). On engine servers named as such (`--agent
vllm+http://HOST:PORT`, `sglang+http://...`) they go through `kvctl.engine_levers`, which knows
each engine's routes and the flag that enables them; an engine without the lever (TensorRT-LLM)
is a usage error before anything is sent, as is `--model` there (an engine serves one).
`sleep --status` only asks whether each model or server sleeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Group, RenderableType
from rich.text import Text

from kvctl.cli.options import (
    AgentOption,
    ExitCode,
    JsonOption,
    Target,
    TimeoutOption,
    TokenOption,
    YesOption,
    fail,
    resolve,
)
from kvctl.cli.output import Outcome, confirm, finish, on_agent
from kvctl.units import format_bytes
from kvctl.view.untrusted import clean

if TYPE_CHECKING:
    from kvctl.api import PoolList, SleepRequest, SleepResult, WakeResult
    from kvctl.client import AgentClient
    from kvctl.engine_levers import LeverResult
    from kvctl.engines import Engine

ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "--pool",
        metavar="NAME",
        help="On a kvctl agent, the model to sleep or wake \\[default: its only model].",
        show_default=False,
    ),
]


def sleep(
    ctx: typer.Context,
    model: ModelOption = None,
    level: Annotated[
        int | None,
        typer.Option(
            "--level",
            min=1,
            max=2,
            metavar="1|2",
            help="1 releases the KV cache and keeps the weights in host memory, 2 drops both "
            "(a kvctl agent reloads them from the checkpoint on wake) \\[default: 1].",
            show_default=False,
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="On a kvctl agent, sleep its last awake model too: every request then waits "
            "for a wake.",
        ),
    ] = False,
    show: Annotated[
        bool, typer.Option("--status", help="Only say whether each model or server sleeps.")
    ] = False,
    yes: YesOption = False,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Put a model to sleep: free its KV memory (and at --level 2 its weights) until
    `kvctl wake` or, on a kvctl agent, its next request.

    On a kvctl agent the KV pool goes back to the budget the agent's other models share;
    refused while the model has requests or pinned prefixes, and for the last awake model
    without --force. vLLM needs VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode (checked
    first: without it vLLM would abort its requests and free nothing); it aborts the requests
    running. SGLang needs --enable-memory-saver and must be idle. TensorRT-LLM has no sleep
    kvctl pulls.

    Asks first (skip with --yes). With --status it only reads.
    """
    from kvctl.engine_levers import SLEEP, SLEEP_STATE

    if show and (level is not None or force):
        fail("--level and --force are a sleep's; --status only reads", ExitCode.USAGE)
    target = resolve(ctx, agent, token, json_out, timeout)
    lever = SLEEP_STATE if show else SLEEP
    engines = _engines(target, lever, model)
    if not show:
        for url, engine in engines.items():
            if engine is not None and engine.name != "vllm" and level is not None:
                fail(
                    f"{url}: --level is vLLM's; {engine.title} releases its weights and KV "
                    "cache together",
                    ExitCode.USAGE,
                )
            if engine is not None and force:
                fail(f"{url}: --force is a kvctl agent's", ExitCode.USAGE)
        confirm(_question(target, model), yes)
    request = _sleep_request(level or 1, force)
    outcomes: list[Outcome[Any]] = []
    for url, engine in engines.items():
        if engine is None and show:
            outcomes.append(on_agent(target, url, lambda client: client.pools()))
        elif engine is None:
            outcomes.append(on_agent(target, url, lambda c: c.sleep(_model(c, model), request)))
        else:
            vllm_level = (level or 1) if engine.name == "vllm" and not show else None
            outcomes.append(pull_outcome(target, url, lever, vllm_level))
    finish(target, outcomes, render_result, as_json=as_json)


def wake(
    ctx: typer.Context,
    model: ModelOption = None,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Wake a model put to sleep by `kvctl sleep`: its KV memory and weights come back and it
    serves again; answers once it can (a level-2 wake on a kvctl agent reloads the checkpoint:
    give --timeout for a large one). Engines: vLLM needs VLLM_SERVER_DEV_MODE=1; SGLang
    always wakes."""
    from kvctl.engine_levers import WAKE

    target = resolve(ctx, agent, token, json_out, timeout)
    outcomes: list[Outcome[Any]] = []
    for url, engine in _engines(target, WAKE, model).items():
        if engine is None:
            outcomes.append(on_agent(target, url, lambda c: c.wake(_model(c, model))))
        else:
            outcomes.append(pull_outcome(target, url, WAKE))
    finish(target, outcomes, render_result, as_json=as_json)


def _engines(target: Target, lever: str, model: str | None) -> dict[str, Engine | None]:
    """Each `--agent` with its engine (None: a kvctl agent); a usage error, before anything is
    sent, for an engine without `lever` or given `--model`."""
    from kvctl.engine_levers import LeverMissing, engine_target, lever_of

    engines: dict[str, Engine | None] = {}
    for agent in target.agents:
        engine, _ = engine_target(agent)
        if engine is not None:
            if model is not None:
                fail(
                    f"{agent}: --model names a kvctl agent's model; {engine.title} serves one",
                    ExitCode.USAGE,
                )
            try:
                lever_of(engine, lever)
            except LeverMissing as error:
                fail(f"{agent}: {error}", ExitCode.USAGE)
        engines[agent] = engine
    return engines


def _model(client: AgentClient, model: str | None) -> str:
    """The model named, or the agent's only one (AgentNeedsPool when it serves several)."""
    return model if model is not None else client.pool().pool


def _sleep_request(level: int, force: bool) -> SleepRequest:
    from kvctl.api import SleepRequest

    return SleepRequest(level=2 if level == 2 else 1, force=force)


def _question(target: Target, model: str | None) -> str:
    which = target.agents[0] if len(target.agents) == 1 else f"{len(target.agents)} servers"
    if model is not None:
        which = f"model {model} on {which}"
    return (
        f"Put {which} to sleep? Its KV cache is dropped until it wakes (an engine's running "
        "requests are aborted; a kvctl agent refuses while it has any)"
    )


def pull_outcome(
    target: Target, agent: str, lever: str, level: int | None = None
) -> Outcome[LeverResult]:
    """One server's lever, its error kept for `finish`."""
    from kvctl.client import AgentError
    from kvctl.engine_levers import pull

    try:
        return Outcome(agent, result=pull(agent, lever, target.token, target.timeout, level))
    except AgentError as error:
        return Outcome(agent, error=error)


def as_json(result: Any) -> Any:
    """An engine's lever result as its own JSON, an agent's answer as the API's."""
    from kvctl.cli.output import to_jsonable
    from kvctl.engine_levers import LeverResult

    return result.as_json() if isinstance(result, LeverResult) else to_jsonable(result)


def render_result(result: Any) -> RenderableType:
    """One line per server or model: what it now is (`kvctl prefix clear` shows an engine's
    result so too)."""
    from kvctl.api import PoolList, SleepResult, WakeResult

    if isinstance(result, SleepResult):
        return _slept(result)
    if isinstance(result, WakeResult):
        return _woke(result)
    if isinstance(result, PoolList):
        return _sleep_states(result)
    return _lever(result)


def _slept(result: SleepResult) -> Text:
    weights = (
        f", {format_bytes(result.weights_bytes)} of weights "
        + ("dropped" if result.level == 2 else "moved to host memory")
        if result.weights_bytes
        else ""
    )
    model = clean(result.pool)
    return Text(
        f"model {model}: asleep (level {result.level}): {format_bytes(result.kv_bytes)} of KV "
        f"released{weights}; `kvctl wake --model {model}` or its next request wakes it"
    )


def _woke(result: WakeResult) -> Text:
    model = clean(result.pool)
    if not result.woke:
        return Text(f"model {model}: awake already")
    reloaded = ", weights reloaded" if result.weights_reloaded else ""
    return Text(
        f"model {model}: awake in {result.wake_seconds:.2f} s "
        f"({result.capacity_pages:,} pages{reloaded})"
    )


def _sleep_states(listing: PoolList) -> Group:
    lines = []
    for pool in listing.pools:
        state = pool.sleep
        said: str = state.state
        if state.level is not None:
            since = state.asleep_seconds or 0.0
            released = format_bytes(state.released_bytes)
            said += f" (level {state.level}, {since:.0f} s, {released} released)"
        lines.append(Text(f"model {clean(pool.pool)}: {said}"))
    return Group(*lines)


def _lever(result: LeverResult) -> Text:
    from kvctl.engine_levers import PREFIX_CLEAR, SLEEP, WAKE
    from kvctl.engines import engine_named

    engine = engine_named(result.engine).title
    url = result.agent.partition("+")[2]
    if result.lever == PREFIX_CLEAR:
        said = "prefix cache cleared"
    elif result.lever == SLEEP:
        level = f" (level {result.level})" if result.level else ""
        said = f"asleep{level}; `kvctl --agent {result.agent} wake` wakes it"
    elif result.lever == WAKE and result.sleeping:
        said = "woken in part: some of its memory is still released"
    elif result.lever == WAKE:
        said = "awake"
    else:
        said = "asleep" if result.sleeping else "awake"
    return Text(f"{engine} {clean(url)}: {said}")
