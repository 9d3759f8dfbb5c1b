"""`kvctl alerts list|rules|test`: what fires now, the Prometheus rules, a test notification.

The rule file and the Alertmanager client live in `kvctl.alerts`, imported inside the commands
so `kvctl --help` does not load them.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvctl.cli.options import (
    AgentOption,
    ExitCode,
    JsonOption,
    TimeoutOption,
    TokenOption,
    fail,
    resolve,
)
from kvctl.cli.output import console, finish, on_each, print_json
from kvctl.view import render
from kvctl.view.untrusted import PROSE_LIMIT, clean

alerts_app = typer.Typer(
    help="List firing alerts, print the Prometheus rule file, send a test alert.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


@alerts_app.command("list")
def list_alerts(
    ctx: typer.Context,
    firing: Annotated[bool, typer.Option("--firing", help="Only alerts that fire now.")] = False,
    from_am: Annotated[
        str | None,
        typer.Option(
            "--from-am",
            metavar="URL",
            help="Read kvctl's alerts (its agents' and its engine rule files') from this "
            "Alertmanager instead of the agents.",
        ),
    ] = None,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """List the agent's pending and firing alerts, each with the command that fixes it."""
    if from_am is not None:
        _list_from_alertmanager(ctx, _alertmanager_url("--from-am", from_am), json_out, timeout)
        return
    target = resolve(ctx, agent, token, json_out, timeout)

    def read(client: Any) -> Any:
        from kvctl.api import AlertList

        alerts = client.alerts().alerts
        return AlertList(alerts=[a for a in alerts if a.state == "firing" or not firing])

    finish(target, on_each(target, read), lambda found: render.alerts_table(found.alerts))


def _alertmanager_url(flag: str, url: str) -> str:
    """An Alertmanager URL as given, or a usage error that shows one."""
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        fail(
            f"{flag} {url!r} is not an Alertmanager URL; give one such as http://localhost:9093",
            ExitCode.USAGE,
        )
    return url


def _list_from_alertmanager(
    ctx: typer.Context, url: str, json_out: bool, timeout: float | None
) -> None:
    """The kvctl alerts Alertmanager holds: what reached the on-call side, from every agent."""
    from datetime import datetime

    from kvctl.alerts import AlertmanagerError, fetch_alerts
    from kvctl.api import Alert

    target = resolve(ctx, json_out=json_out, timeout=timeout)
    try:
        raw = fetch_alerts(url, timeout=target.timeout)
    except AlertmanagerError as error:
        fail(str(error), ExitCode.ERROR)
    if target.json:
        print_json(raw)
        return
    alerts = []
    for item in raw:
        labels, notes = item.get("labels", {}), item.get("annotations", {})
        severity = labels.get("severity", "warning")
        alerts.append(
            Alert(
                name=labels.get("alertname", "?"),
                severity=severity if severity in ("info", "warning", "critical") else "warning",
                state="firing",
                value=None,
                summary=notes.get("summary", ""),
                description=notes.get("description", ""),
                remediation=notes.get("remediation", ""),
                runbook_url=notes.get("runbook_url", ""),
                active_since=datetime.fromisoformat(item["startsAt"]).timestamp(),
                labels=labels,
            )
        )
    console().print(render.alerts_table(alerts))


@alerts_app.command("rules")
def rules(
    ctx: typer.Context,
    runbook_url: Annotated[
        str | None,
        typer.Option(
            "--runbook-url",
            metavar="BASE",
            help="Absolute base of the alerts' runbook links, where docs/alerts.md is served "
            "(any agent serves it at /runbook); default: a placeholder under .invalid.",
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            metavar="ENGINE",
            help="Whose rule file: kvctl (its agents), vllm or sglang (the alerts on those "
            "servers' own metrics).",
        ),
    ] = "kvctl",
    job: Annotated[
        str | None,
        typer.Option(
            "--job",
            metavar="NAME",
            help="The Prometheus job that scrapes the agents (their --prometheus-job) or the "
            "engine's servers; default: kvctl-agent, vllm, sglang.",
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="alerts.NAME=VALUE",
            help="An alert setting your agents use, e.g. alerts.pressure_high=0.9 (repeatable; "
            "kvctl's file reads alerts.for_s and alerts.pressure_high, an engine's names those "
            "it reads in its header).",
        ),
    ] = None,
    json_out: JsonOption = False,
) -> None:
    """Print the Prometheus rule file: recording rules, and the alerts only Prometheus can
    raise (an agent down or absent, fleet aggregates); every per-node alert is the agent's own.
    With --engine vllm or sglang, the alerts on those servers' own metrics instead.

    For Prometheus: kvctl alerts rules --runbook-url URL > kvctl-rules.yml, then list it under
    rule_files.
    """
    from urllib.parse import urlsplit

    from kvctl.alerts import RULES_RUNBOOK_BASE, render_rule_file
    from kvctl.alerts.catalog import AGENT_JOB
    from kvctl.alerts.engine_rules import PROFILES, render_engine_rule_file
    from kvctl.engines import KVCTL

    if engine != KVCTL and engine not in PROFILES:
        known = ", ".join([KVCTL, *PROFILES])
        fail(f"--engine {engine!r}: no rule file for it; expected one of {known}", ExitCode.USAGE)

    target = resolve(ctx, json_out=json_out)
    base = runbook_url or RULES_RUNBOOK_BASE
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        fail(
            f"--runbook-url must be an absolute http(s) URL such as "
            f"http://gpu-node-1:8477/runbook, got {base!r}",
            ExitCode.USAGE,
        )
    settings = _alert_settings(set_ or [])
    if engine == KVCTL:
        text = render_rule_file(settings, runbook_base=base, job=job or AGENT_JOB)
    else:
        text = render_engine_rule_file(engine, settings, runbook_base=base, job=job)
    if target.json:
        import yaml

        print_json(yaml.safe_load(text))
    else:
        typer.echo(text, nl=not text.endswith("\n"))


def _alert_settings(assignments: list[str]) -> Any:
    """`alerts.*` settings from `--set` assignments, checked as the agent checks them."""
    from kvctl.settings import SettingsError, from_text, validate

    pairs = {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not key.strip().startswith("alerts."):
            fail(
                f"--set {assignment!r}: write --set alerts.NAME=VALUE, "
                "e.g. alerts.pressure_high=0.9",
                ExitCode.USAGE,
            )
        pairs[key.strip()] = value
    try:
        return validate(from_text(pairs)).alerts
    except SettingsError as error:
        fail(f"--set {error}", ExitCode.USAGE)


@alerts_app.command("test")
def test_alert(
    ctx: typer.Context,
    alertmanager_url: Annotated[
        str | None,
        typer.Option(
            "--alertmanager-url",
            metavar="URL",
            envvar="KVCTL_ALERTMANAGER_URL",
            help="Post the test alert to this Alertmanager directly, e.g. "
            "http://localhost:9093, instead of asking the agents to send it.",
        ),
    ] = None,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
    timeout: TimeoutOption = None,
) -> None:
    """Send a test alert, to check the route to your pager end to end.

    By default each agent sends it through its own Alertmanager route, labels and credentials
    (and logs it in its audit trail); with --alertmanager-url it is posted from here.
    """
    if alertmanager_url is not None:
        url = _alertmanager_url("--alertmanager-url", alertmanager_url)
        _test_alertmanager(ctx, url, json_out, timeout)
        return
    target = resolve(ctx, agent, token, json_out, timeout)

    def render_sent(sent: dict) -> Any:
        from rich.text import Text

        labels = sent.get("alert", {}).get("labels", {})
        shown = ", ".join(f"{clean(k)}={clean(v)}" for k, v in labels.items())
        return Text(f"test alert sent to the agent's Alertmanager ({shown}); check your receivers")

    finish(target, on_each(target, lambda client: client.send_test_alert()), render_sent)


def _test_alertmanager(ctx: typer.Context, url: str, json_out: bool, timeout: float | None) -> None:
    """Post the test alert from this machine straight to one Alertmanager."""
    from kvctl.alerts import AlertmanagerError, post_test_alert

    target = resolve(ctx, json_out=json_out, timeout=timeout)
    try:
        alert = post_test_alert(url, timeout=target.timeout)
    except AlertmanagerError as error:
        fail(str(error), ExitCode.ERROR)
    if target.json:
        print_json({"alertmanager_url": url, "sent": True, "alert": alert})
        return
    labels = ", ".join(f"{k}={v}" for k, v in alert.get("labels", {}).items())
    said = f"test alert sent to {url} ({labels}); check that your receivers got it"
    typer.echo(clean(said, PROSE_LIMIT))
