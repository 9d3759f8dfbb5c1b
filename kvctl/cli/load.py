"""`kvctl load`: drive realistic traffic at an agent and report what users would have seen.

The runner and profiles are imported inside the command so `kvctl --help` stays fast. The
progress bar and notices go to stderr, so the report (or the JSON) alone is on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kvctl.cli.options import (
    AgentOption,
    ExitCode,
    JsonOption,
    Target,
    TimeoutOption,
    TokenOption,
    fail,
    resolve,
)
from kvctl.cli.output import console, exit_code_of, only_one, print_json, report_error
from kvctl.view import fmt
from kvctl.view.untrusted import PROSE_LIMIT, clean, safe

if TYPE_CHECKING:
    from kvctl.load.report import LoadReport
    from kvctl.load.runner import LoadRun, LoadSettings

QUANTILES = ("p50", "p90", "p99", "max")


class ProfileName(StrEnum):
    """Workload profiles (see kvctl/load/profiles.py)."""

    CHAT = "chat"
    RANDOM_LENGTHS = "random-lengths"
    LONG_CONTEXT = "long-context"
    BURST = "burst"


def load(
    ctx: typer.Context,
    profile: Annotated[
        ProfileName, typer.Option("--profile", "-p", help="Workload profile.")
    ] = ProfileName.CHAT,
    rate: Annotated[
        float | None,
        typer.Option(
            "--rate", min=0.01, help="Requests per second, open loop.", show_default=False
        ),
    ] = None,
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency",
            "-c",
            min=1,
            max=1024,
            help="Requests in flight \\[default: 4; with a rate, a cap of 64].",
            show_default=False,
        ),
    ] = None,
    duration: Annotated[
        float, typer.Option("--duration", "-d", min=0.1, max=86400, help="Seconds to send for.")
    ] = 30.0,
    requests: Annotated[
        int | None,
        typer.Option("--requests", "-n", min=1, help="Stop after this many.", show_default=False),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, max=4096, help="Tokens per completion.")
    ] = 32,
    seed: Annotated[int, typer.Option("--seed", help="Seed of prompts and sampling.")] = 0,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="The model requests name, when the agent serves several (run one kvctl load "
            "per model to load several).",
            show_default=False,
        ),
    ] = None,
    list_profiles: Annotated[
        bool,
        typer.Option(
            "--list-profiles", help="List the workload profiles and exit (sends nothing)."
        ),
    ] = False,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Send requests from a workload profile, then print latency percentiles and tokens/s.

    Chat goes to /v1/chat/completions when the model has a chat template, else text prompts
    to /v1/completions; lengths are in the model's tokens, counted by the agent.

    Profiles: chat (multi-turn, shared system prompt), random-lengths, long-context, burst
    (--list-profiles says what each sends).

    Closed loop at --concurrency, or open loop at --rate (burst: 8/s in bursts of 16).

    It stops at --duration or --requests, whichever comes first.
    """
    from kvctl.client import AgentError
    from kvctl.load.runner import LoadSettings
    from kvctl.load.setup import ModelRequired

    if list_profiles:
        _print_profiles(json_out or resolve(ctx, json_out=json_out).json)
        return
    target = resolve(ctx, agent, token, json_out, timeout)
    only_one(target, "kvctl load")
    settings = LoadSettings(
        profile=profile.value,
        seed=seed,
        max_tokens=max_tokens,
        rate=rate,
        concurrency=concurrency,
        duration=duration,
        requests=requests,
        model=model,
    )
    try:
        report = asyncio.run(_drive(target, settings))
    except AgentError as error:
        report_error(error)
        raise typer.Exit(int(exit_code_of(error))) from None
    except ModelRequired as missing:
        fail(str(missing), ExitCode.USAGE)
    if target.json:
        print_json(report.to_json())
    else:
        console().print(report_view(report))
    if report.stopped_by is not None:
        signum = getattr(signal, report.stopped_by, None)
        fail(
            f"stopped by {report.stopped_by} after {report.duration_s:.1f} s; the report above "
            "covers what was sent until then",
            128 + int(signum) if signum is not None else ExitCode.ERROR,
        )
    if report.results and not report.completed:
        fail(f"all {len(report.results)} requests failed; see the errors above", ExitCode.ERROR)


async def _drive(target: Target, settings: LoadSettings) -> LoadReport:
    """Check the agent answers (a clear error beats a run of failures), learn its model's chat
    support and tokens, then run."""
    from kvctl.client import AsyncAgentClient
    from kvctl.load.runner import LoadRun
    from kvctl.load.setup import prepare

    timeout = max(target.timeout, 120.0)
    async with AsyncAgentClient(target.agents[0], target.token, timeout) as client:
        await client.health()
        plan = await prepare(client, settings.model)
        for notice in plan.notices:
            typer.echo(f"kvctl load: {clean(notice, PROSE_LIMIT)}", err=True)
        run = LoadRun(client, settings, plan=plan)
        with _stopping_on_signals(run):
            if target.json:
                return await run.run()
            return await _with_progress(run, settings)


@contextlib.contextmanager
def _stopping_on_signals(run: LoadRun) -> Iterator[None]:
    """SIGTERM and SIGINT stop the run and leave its report to print (POSIX event loops)."""
    loop = asyncio.get_running_loop()
    installed = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, run.stop, signal.Signals(signum).name)
        except (NotImplementedError, RuntimeError):  # not the main thread, or not POSIX
            continue
        installed.append(signum)
    try:
        yield
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)


async def _with_progress(run: LoadRun, settings: LoadSettings) -> LoadReport:
    """The run under a rich progress bar on stderr: requests done of `--requests`, or time."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[done]}"))
    progress = Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True))
    total = settings.requests or settings.duration
    bar = progress.add_task(f"load {settings.profile}", total=total, done="0 done, 0 failed")

    def tick() -> None:
        results = run.results
        failed = sum(r.error is not None for r in results)
        elapsed = run.clock() - run.started if run.started else 0.0
        progress.update(
            bar,
            completed=len(results) if settings.requests else min(elapsed, settings.duration),
            done=f"{len(results) - failed} done, {failed} failed",
        )

    run.on_result = lambda _result: tick()
    with progress:
        task = asyncio.create_task(run.run())
        while not task.done():
            tick()
            await asyncio.wait({task}, timeout=0.25)
        tick()
        return task.result()


def _print_profiles(as_json: bool) -> None:
    from kvctl.load.profiles import PROFILES

    rows = [
        {"profile": p.name, "summary": p.summary, "default_rate": p.default_rate}
        for p in PROFILES.values()
    ]
    if as_json:
        print_json({"profiles": rows})
        return
    table = Table(show_edge=False, box=None)
    for column in ("profile", "what it sends", "default"):
        table.add_column(column, style="bold" if column == "profile" else None)
    for profile in PROFILES.values():
        rate = profile.default_rate
        table.add_row(
            profile.name, profile.summary, f"open loop, {rate:g}/s" if rate else "closed loop"
        )
    console().print(table)


def report_view(report: LoadReport) -> Group:
    """Percentiles of time to first token and of total latency, then throughput and errors."""
    data = report.to_json()
    title = Text(f"kvctl load: {report.profile}, seed {report.seed}, {clean(report.endpoint)}")
    latency = Table(title=title, show_edge=False)
    latency.add_column("seconds", style="bold")
    for column in QUANTILES:
        latency.add_column(column, justify="right")
    for label, key in (("time to first token", "ttft_s"), ("latency", "latency_s")):
        latency.add_row(label, *(fmt.seconds(data[key][q]) for q in QUANTILES))
    return Group(latency, _summary(report, data))


def _summary(report: LoadReport, data: dict[str, Any]) -> Table:
    counts, tokens = data["requests"], data["tokens"]
    mode = f"open loop at {report.rate:g}/s" if report.rate else "closed loop"
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row(
        "driven", f"{mode}, at most {report.concurrency} in flight, {report.duration_s:.1f} s"
    )
    table.add_row(
        "requests",
        f"{counts['sent']} sent, {counts['completed']} ok, {counts['failed']} failed, "
        f"{counts['cancelled']} cancelled ({data['requests_per_s']:.2f}/s)",
    )
    prompts = data["prompt_tokens"]
    if prompts["max"] is not None:
        table.add_row(
            "prompts",
            f"{prompts['p50']:,.0f} tokens p50, {prompts['p90']:,.0f} p90, "
            f"{prompts['max']:,.0f} max",
        )
    table.add_row(
        "tokens",
        f"{tokens['output']:,} out ({data['output_tokens_per_s']:.1f}/s), "
        f"{tokens['prompt']:,} prompt, {_cached_text(tokens['cached_prompt'])}",
    )
    for message, count in list(data["errors"].items())[:5]:
        table.add_row(Text(f"error ×{count}", style=fmt.BAD), safe(message, limit=PROSE_LIMIT))
    return table


def _cached_text(cached: int | None) -> str:
    if cached is None:
        return (
            "cached prompt tokens not in the answers (`kvctl status` shows the prefix hit rate; "
            "an agent started with --report-cached-tokens puts them in each answer)"
        )
    return f"{cached:,} from the prefix cache"
