"""`kvctl alerts list|rules|test`: what fires now, the Prometheus rules, a test notification.

The rule file and the Alertmanager client live in `kvctl.alerts`, imported inside the commands
so `kvctl --help` does not load them.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvctl.cli import render
from kvctl.cli.options import AgentOption, ExitCode, JsonOption, TokenOption, fail, resolve
from kvctl.cli.output import console, finish, on_each, print_json

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
            help="Read kvctl's alerts from this Alertmanager instead of the agents.",
        ),
    ] = None,
    agent: AgentOption = None,
    token: TokenOption = None,
    json_out: JsonOption = False,
) -> None:
    """List the agent's pending and firing alerts, each with the command that fixes it."""
    if from_am is not None:
        _list_from_alertmanager(ctx, from_am, json_out)
        return
    target = resolve(ctx, agent, token, json_out)

    def read(client: Any) -> Any:
        from kvctl.api import AlertList

        alerts = client.alerts().alerts
        return AlertList(alerts=[a for a in alerts if a.state == "firing" or not firing])

    finish(target, on_each(target, read), lambda found: render.alerts_table(found.alerts))


def _list_from_alertmanager(ctx: typer.Context, url: str, json_out: bool) -> None:
    """The kvctl alerts Alertmanager holds: what reached the on-call side, from every agent."""
    from datetime import datetime

    from kvctl.alerts import AlertmanagerError, fetch_alerts
    from kvctl.api import Alert

    target = resolve(ctx, json_out=json_out)
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
def rules(ctx: typer.Context, json_out: JsonOption = False) -> None:
    """Print the Prometheus rule file with the same alerts the agent evaluates.

    For Prometheus: kvctl alerts rules > kvctl-rules.yml, then list it under rule_files.
    """
    from kvctl.alerts import render_rule_file

    target = resolve(ctx, json_out=json_out)
    text = render_rule_file()
    if target.json:
        import yaml

        print_json(yaml.safe_load(text))
    else:
        typer.echo(text, nl=not text.endswith("\n"))


@alerts_app.command("test")
def test_alert(
    ctx: typer.Context,
    alertmanager_url: Annotated[
        str,
        typer.Option(
            "--alertmanager-url",
            metavar="URL",
            envvar="KVCTL_ALERTMANAGER_URL",
            help="Alertmanager to send a test alert to, e.g. http://localhost:9093.",
        ),
    ],
    json_out: JsonOption = False,
) -> None:
    """Send a test alert to Alertmanager, to check the route to your pager end to end."""
    from kvctl.alerts import AlertmanagerError, post_test_alert

    target = resolve(ctx, json_out=json_out)
    try:
        alert = post_test_alert(alertmanager_url, timeout=target.timeout)
    except AlertmanagerError as error:
        fail(str(error), ExitCode.ERROR)
    if target.json:
        print_json({"alertmanager_url": alertmanager_url, "sent": True, "alert": alert})
        return
    labels = ", ".join(f"{k}={v}" for k, v in alert.get("labels", {}).items())
    typer.echo(
        f"test alert sent to {alertmanager_url} ({labels}); check that your receivers got it"
    )
