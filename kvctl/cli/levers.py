"""`kvctl sleep` and `kvctl wake`: pull another engine's sleep and wake levers.

They act on engine servers named as such (`--agent vllm+http://HOST:PORT`,
`sglang+http://...`), through `kvctl.engine_levers`, which knows each engine's routes and the
flag that enables them. A kvctl agent does not sleep its models in this version, so a plain
agent URL is a usage error, as is an engine without the lever (TensorRT-LLM): both before
anything is sent. `sleep --status` only asks whether a server sleeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
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
from kvctl.cli.output import Outcome, confirm, finish
from kvctl.view.untrusted import clean

if TYPE_CHECKING:
    from kvctl.engine_levers import LeverResult
    from kvctl.engines import Engine

NOT_ON_AGENTS = (
    "{agent} is a kvctl agent: kvctl agents do not sleep their models in this version; "
    "`kvctl sleep` and `kvctl wake` act on an engine's server: --agent vllm+http://HOST:PORT "
    "or sglang+http://HOST:PORT"
)


def sleep(
    ctx: typer.Context,
    level: Annotated[
        int | None,
        typer.Option(
            "--level",
            min=1,
            max=2,
            metavar="1|2",
            help="vLLM's sleep level: 1 moves the weights to host memory and drops the KV "
            "cache, 2 drops both \\[default: 1].",
            show_default=False,
        ),
    ] = None,
    show: Annotated[
        bool, typer.Option("--status", help="Only say whether each server sleeps.")
    ] = False,
    yes: YesOption = False,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Put an engine's server to sleep: free its GPU memory until `kvctl wake`.

    vLLM needs VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode (checked first: without it vLLM
    would abort its requests and free nothing); it aborts the requests running. SGLang needs
    --enable-memory-saver and must be idle. TensorRT-LLM has no sleep kvctl pulls.

    Asks first (skip with --yes). With --status it only asks whether each server sleeps.
    """
    from kvctl.engine_levers import SLEEP, SLEEP_STATE

    if show and level is not None:
        fail("--level is a sleep's; --status only reads", ExitCode.USAGE)
    target = resolve(ctx, agent, token, json_out, timeout)
    lever = SLEEP_STATE if show else SLEEP
    engines = _engines(target, lever)
    if not show:
        for url, engine in engines.items():
            if engine.name != "vllm" and level is not None:
                fail(
                    f"{url}: --level is vLLM's; {engine.title} releases its weights and KV "
                    "cache together",
                    ExitCode.USAGE,
                )
        level = level or 1
        confirm(_question(target), yes)
    outcomes = [
        pull_outcome(target, url, lever, level if engine.name == "vllm" and not show else None)
        for url, engine in engines.items()
    ]
    finish(target, outcomes, render_result, as_json=lambda result: result.as_json())


def wake(
    ctx: typer.Context,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Wake an engine's server put to sleep by `kvctl sleep`: its weights and KV cache come
    back, and it serves again (vLLM: VLLM_SERVER_DEV_MODE=1; SGLang: always)."""
    from kvctl.engine_levers import WAKE

    target = resolve(ctx, agent, token, json_out, timeout)
    outcomes = [pull_outcome(target, url, WAKE) for url in _engines(target, WAKE)]
    finish(target, outcomes, render_result, as_json=lambda result: result.as_json())


def _engines(target: Target, lever: str) -> dict[str, Engine]:
    """Each `--agent` with its engine; a usage error, before anything is sent, for a kvctl
    agent or an engine without `lever`."""
    from kvctl.engine_levers import LeverMissing, engine_target, lever_of

    engines: dict[str, Engine] = {}
    for agent in target.agents:
        engine, _ = engine_target(agent)
        if engine is None:
            fail(NOT_ON_AGENTS.format(agent=agent), ExitCode.USAGE)
        try:
            lever_of(engine, lever)
        except LeverMissing as error:
            fail(f"{agent}: {error}", ExitCode.USAGE)
        engines[agent] = engine
    return engines


def _question(target: Target) -> str:
    which = target.agents[0] if len(target.agents) == 1 else f"{len(target.agents)} servers"
    return (
        f"Put {which} to sleep? Requests running there are aborted (vLLM) and the KV cache "
        "is dropped until `kvctl wake`"
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


def render_result(result: LeverResult) -> Text:
    """One line: the server and what it now is (`kvctl prefix clear` shows its result so too)."""
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
