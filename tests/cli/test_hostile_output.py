"""The CLI against nodes with hostile names: exit 0, names shown escaped, no control obeyed.

One HTTP server plays every source: a kvctl agent whose pool, device, version and alerts are
hostile, one whose errors are, a vLLM whose /metrics names two hostile models, and a Prometheus
whose instance, model and alert labels are hostile. `kvctl status` (agent, engine and
`--prometheus`), `top --once`, `top --headless`, `pool show`, `defrag` and `alerts list` print
them as `kvctl.view.untrusted` escapes them: `[/]` no longer ends the command with a
MarkupError, `[bold red]owned[/]` is not styled, and no ESC, C1 CSI, BEL or bidi override reaches
stdout or stderr.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from exposition_server import JSON, TEXT, ExpositionServer
from pool_readings import pool_snapshot

from kvctl.api import Alert, AlertList, ErrorBody, Health, PoolList
from kvctl.prometheus_fleet import ENGINE_LABEL, MODEL_LABEL

CLOSE = "[/]"
STYLED = "[bold red]owned[/]"
CLIPBOARD = "\x1b]52;c;ZXZpbA==\x07"
CONTROLS = f"{CLIPBOARD}\x1b[2J\x1b]0;title\x07\x9b31m\u202e"
NAME = f"{CLOSE}{STYLED}{CONTROLS}"
"""Markup that closes nothing, markup that styles, and terminal controls, in one name."""
SHOWN = "[/][bold red]owned[/]\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J\\x1b]0;title\\x07\\x9b31m\\u202e"
"""The name as every view shows it."""
RAW = ("\x1b", "\x9b", "\x07", "\u202e")
VLLM_FILE = Path(__file__).parent.parent / "fixtures" / "expositions" / "vllm-0.32.0-busy.txt"


def vllm_exposition() -> str:
    """vLLM's recorded exposition, serving two models with hostile names instead of one."""
    lines = []
    for line in VLLM_FILE.read_text().splitlines():
        if 'model_name="smollm"' in line:
            lines.append(line.replace("smollm", NAME))
            lines.append(line.replace("smollm", f"second {NAME}"))
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def agent_answer(route: str, several: bool = False) -> tuple[int, str]:
    """The hostile agent's answer to `route`; with `several`, it serves a second model."""
    pool = pool_snapshot(pool=NAME, device=NAME)
    pools = [pool, pool_snapshot(pool=f"second {NAME}", device=NAME)] if several else [pool]
    alert = Alert(
        name=NAME, severity="critical", state="firing", value=None, summary=NAME,
        description=NAME, remediation=NAME, runbook_url=NAME, active_since=0.0,
        labels={"pool": NAME},
    )  # fmt: skip
    answers = {
        "/healthz": Health(status="ok", pool=NAME, version=NAME, uptime_seconds=5.0),
        "/v1/pools": PoolList(pools=pools),
        "/v1/pool": pool,
        "/v1/alerts": AlertList(alerts=[alert]),
    }
    if route in answers:
        return 200, answers[route].model_dump_json()
    return 404, error_body(f"no route {route}", "not_found", 404)


def error_body(message: str, kind: str, code: int) -> str:
    error = {"message": message, "type": kind, "code": code}
    return ErrorBody.model_validate({"error": error}).model_dump_json()


def prometheus_answer(query: str, instances: list[str]) -> str:
    """Prometheus's vector for `query`: every target up, a vLLM row per instance with a hostile
    model, a hostile alert each."""
    if query.startswith("up"):
        series = [{"job": "j", "instance": i, "__name__": "up"} for i in instances]
    elif query.startswith("ALERTS"):
        series = [{"alertname": NAME, "instance": i, "severity": "critical"} for i in instances]
    elif query.startswith("label_replace"):
        series = [
            {"job": "j", "instance": i, MODEL_LABEL: m, ENGINE_LABEL: "vllm"}
            for i in instances
            for m in (NAME, f"second {NAME}")
        ]
    else:
        series = []
    result = [{"metric": labels, "value": [0, "1"]} for labels in series]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


class HostileServer(ExpositionServer):
    """/agent: the hostile agent (/pools: serving two models); /broken: an agent whose errors
    are hostile; /vllm: the vLLM;
    /prom1 and /prom2: a Prometheus of one and of two hostile instances."""

    def __init__(self) -> None:
        super().__init__(kinds=("vllm",))

    def answer(self, target: str) -> tuple[int, str, str]:
        parts = urlsplit(target)
        head, _, rest = parts.path.lstrip("/").partition("/")
        rest = "/" + rest
        if head in ("agent", "pools"):
            status, body = agent_answer(rest, several=head == "pools")
            return status, JSON, body
        if head == "broken":
            return 500, JSON, error_body(f"agent said {NAME}", "internal_error", 500)
        if head == "vllm" and rest == "/metrics":
            return 200, TEXT, vllm_exposition()
        if head in ("prom1", "prom2") and rest == "/api/v1/query":
            query = parse_qs(parts.query)["query"][0]
            instances = [f"{NAME}:1", f"b{NAME}:2"][: int(head[-1])]
            return 200, JSON, prometheus_answer(query, instances)
        return 404, JSON, json.dumps({"detail": "Not Found"})


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with HostileServer().start() as running:
        yield running.url


def assert_inert(result, code: int = 0) -> None:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    for stream in (result.stdout, result.stderr):
        for raw in RAW:
            assert raw not in stream, f"{raw!r} reached the terminal:\n{stream}"
        assert re.search(r"(?<!\])owned", stream) is None, f"markup was applied:\n{stream}"


def test_status_of_an_agent_shows_its_names_escaped(kvctl, server) -> None:
    result = kvctl("status", "-a", f"{server}/agent")
    assert_inert(result)
    assert SHOWN in result.stdout


def test_status_of_an_engine_names_its_models_escaped(kvctl, server) -> None:
    result = kvctl("status", "-a", f"vllm+{server}/vllm")
    assert_inert(result)
    shown, name = ("".join(text.split()) for text in (result.stdout, SHOWN))  # titles fold
    assert f"model{name}" in shown and f"modelsecond{name}" in shown


@pytest.mark.parametrize("prometheus", ["prom1", "prom2"])
def test_status_from_prometheus_shows_labels_escaped(kvctl, server, prometheus) -> None:
    result = kvctl("status", "--prometheus", f"{server}/{prometheus}")
    assert_inert(result)
    assert "[/][bold" in result.stdout and "\\x1b]5" in result.stdout  # cut to fit a cell


def test_a_fleet_and_top_once_and_headless_show_names_and_errors_escaped(kvctl, server) -> None:
    fleet = ["-a", f"{server}/agent", "-a", f"vllm+{server}/vllm", "-a", f"{server}/broken"]
    for command in (["top", "--headless", "--duration", "0"], ["top", "--once"], ["status"]):
        result = kvctl(*command, *fleet)
        assert_inert(result, code=1)
        assert "[/][bold" in result.stdout and "\\x1b]5" in result.stdout  # cut to fit a cell
    assert f"agent said {SHOWN}" in result.stderr  # each down agent's reason, from status


@pytest.mark.parametrize(
    "command", [["pool", "show"], ["defrag"], ["alerts", "list"]], ids=" ".join
)
def test_pool_defrag_and_alerts_show_names_escaped(kvctl, server, command) -> None:
    result = kvctl(*command, "-a", f"{server}/pools")  # an agent of two models names its pools
    assert_inert(result)
    assert f"{CLOSE}{STYLED}\\x1b]52" in result.stdout


def test_a_fleet_of_pools_rules_each_agent_with_its_name_escaped(kvctl, server) -> None:
    result = kvctl("pool", "show", "-a", f"{server}/agent", "-a", f"{server}/broken")
    assert_inert(result, code=1)
    assert f"agent said {SHOWN}" in result.stderr
