"""A hostile or broken source costs its own row, within the timeout, and never the command:
answers that drip, flood or nest are one line each, a NaN or +Inf is "–" with a note, and a
healthy node beside any of them keeps its row. Every source is a real server on 127.0.0.1."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from hostile_server import JSON, Answer, HostileServer, nested

from kvctl import fleet
from kvctl.api import Health
from kvctl.bounded_read import MAX_EXPOSITION_BYTES, MAX_JSON_BYTES, MAX_JSON_DEPTH
from kvctl.cli.options import ExitCode
from kvctl.client import AgentClient, AgentUnreachable
from kvctl.engines import READ_SERIES, VLLM
from kvctl.exposition import Exposition, ExpositionReader, Sample, engine_rows

FIXTURES = Path(__file__).parent.parent / "fixtures" / "expositions"
VLLM_TEXT = (FIXTURES / "vllm-0.32.0-busy.txt").read_text()
TIMEOUT = 1.0
DRIP = 0.2
"""Seconds between bytes: a dripped answer of 40 bytes takes 8 s, well past the timeout."""


def spoiled(text: str, name: str, value: str) -> str:
    """`text` with every sample of `name` valued `value`."""
    return re.sub(rf"^({re.escape(name)}\{{[^}}]*\}}) \S+$", rf"\1 {value}", text, flags=re.M)


def answer(text: str) -> Answer:
    return Answer(text.encode())


def timed(kvctl, *args: str):
    started = time.monotonic()
    result = kvctl(*args)
    return result, time.monotonic() - started


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# ---- an overall deadline --------------------------------------------------------------------


def test_a_dripped_exposition_ends_within_the_timeout(kvctl) -> None:
    drip = Answer(VLLM_TEXT.encode()[:40], drip=DRIP)
    with HostileServer({"/slow/metrics": drip, "/ok/metrics": answer(VLLM_TEXT)}) as server:
        result, took = timed(
            kvctl,
            "status",
            "--agent", f"vllm+{server.url}/slow",
            "--agent", f"vllm+{server.url}/ok",
            "--timeout", str(TIMEOUT),
        )  # fmt: skip
    assert took < 2 * TIMEOUT
    assert result.exit_code == ExitCode.UNREACHABLE
    assert "within 1 s" in one_line(result.stderr)
    assert "smollm" in result.stdout  # the healthy node's row


def test_a_dripped_agent_answer_ends_within_the_timeout(kvctl) -> None:
    headers = Answer(b'{"status": "ok"}', JSON, drip=DRIP, drip_headers=True)
    routes = {"/a/healthz": headers, "/a/v1/pools": headers, "/a/v1/alerts": headers}
    with HostileServer(routes) as server:
        result, took = timed(kvctl, "status", "--agent", f"{server.url}/a", "--timeout", "1")
    assert took < 2 * TIMEOUT
    assert result.exit_code == ExitCode.UNREACHABLE
    assert "within 1 s" in one_line(result.stderr)


def test_the_blocking_client_has_the_deadline_too() -> None:
    health = Health(status="ok", pool="x", version="1", uptime_seconds=1.0, pools=["x"])
    drip = Answer(health.model_dump_json().encode(), JSON, drip=DRIP)
    with HostileServer({"/healthz": drip}) as server:
        client = AgentClient(server.url, timeout=TIMEOUT)
        started = time.monotonic()
        with pytest.raises(AgentUnreachable, match="within 1 s"):
            client.health()
        client.close()
    assert time.monotonic() - started < 2 * TIMEOUT


def test_the_blocking_client_bounds_dripped_headers_too() -> None:
    """httpx's blocking client bounds each read of the headers only: a status line and headers
    dripped a byte at a time kept `kvctl pool show` waiting past its --timeout."""
    drip = Answer(b'{"status": "ok"}', JSON, drip=DRIP, drip_headers=True)
    with HostileServer({"/healthz": drip}) as server:
        client = AgentClient(server.url, timeout=TIMEOUT)
        started = time.monotonic()
        with pytest.raises(AgentUnreachable, match="within 1 s"):
            client.health()
        took = time.monotonic() - started
        client.close()
    assert took < 2 * TIMEOUT


def test_a_dripped_prometheus_answer_ends_within_the_timeout(kvctl) -> None:
    drip = Answer(nested(3), JSON, drip=DRIP)
    with HostileServer({"/prom/api/v1/query": drip}) as server:
        result, took = timed(
            kvctl, "status", "--prometheus", f"{server.url}/prom", "--timeout", "1"
        )
    assert took < 2 * TIMEOUT
    assert result.exit_code == ExitCode.UNREACHABLE
    assert "within 1 s" in one_line(result.stderr)


def test_a_dripped_alertmanager_answer_ends_within_the_timeout(kvctl) -> None:
    drip = Answer(b"[]" + b" " * 40, JSON, drip=DRIP)
    with HostileServer({"/api/v2/alerts": drip}) as server:
        result, took = timed(kvctl, "alerts", "list", "--from-am", server.url, "--timeout", "1")
    assert took < 2 * TIMEOUT
    assert result.exit_code == ExitCode.ERROR
    assert "within 1 s" in one_line(result.stderr)


# ---- a size cap -----------------------------------------------------------------------------


def test_an_exposition_over_the_cap_is_one_line_naming_it(kvctl) -> None:
    flood = Answer(b"# filler\n" * (MAX_EXPOSITION_BYTES // 9 + 1))
    with HostileServer({"/big/metrics": flood, "/ok/metrics": answer(VLLM_TEXT)}) as server:
        result = kvctl(
            "status", "--agent", f"vllm+{server.url}/big", "--agent", f"vllm+{server.url}/ok"
        )
    assert result.exit_code == ExitCode.UNREACHABLE
    assert "larger than 16 MiB" in one_line(result.stderr)
    assert "smollm" in result.stdout


def test_a_prometheus_answer_over_the_cap_is_one_line_naming_it(kvctl) -> None:
    flood = Answer(b'{"status": "success", "pad": "' + b"x" * MAX_JSON_BYTES + b'"}', JSON)
    with HostileServer({"/api/v1/query": flood}) as server:
        result = kvctl("status", "--prometheus", server.url)
    assert result.exit_code == ExitCode.UNREACHABLE
    assert "larger than 8 MiB" in one_line(result.stderr)


def test_a_read_that_fails_early_leaves_no_request_running_into_the_next_poll() -> None:
    """A node's health fails at once while its alerts are still arriving: the read waits
    for the alerts too, or `kvctl top`'s next poll finds the old request still in flight
    (and a node found to be an engine is asked the agent API again)."""
    import asyncio

    from kvctl.client import AsyncAgentClient

    slow_alerts = Answer(b'{"alerts": []}', JSON, drip=0.02)
    with HostileServer({"/n/v1/alerts": slow_alerts}) as server:

        async def read() -> tuple[fleet.Reading, set[asyncio.Task]]:
            client = AsyncAgentClient(f"{server.url}/n", timeout=TIMEOUT * 5)
            try:
                reading = await fleet.read_agent(client)
                return reading, asyncio.all_tasks() - {asyncio.current_task()}
            finally:
                await client.aclose()

        reading, left = asyncio.run(read())
    assert reading.error is not None and not reading.up
    assert not left


# ---- JSON nested too deep -------------------------------------------------------------------


def test_prometheus_nested_too_deep_is_one_line_like_an_unreachable_one(kvctl) -> None:
    deep = Answer(nested(100_000), JSON)
    with HostileServer({"/api/v1/query": deep}) as server:
        result = kvctl("status", "--prometheus", server.url)
    assert result.exit_code == ExitCode.UNREACHABLE
    assert f"deeper than {MAX_JSON_DEPTH} levels" in one_line(result.stderr)


def test_prometheus_answering_no_query_result_is_one_line(kvctl) -> None:
    odd = Answer(b'{"status": "success", "data": {"result": [1, 2]}}', JSON)
    with HostileServer({"/api/v1/query": odd}) as server:
        result = kvctl("status", "--prometheus", server.url)
    assert result.exit_code == ExitCode.UNREACHABLE
    assert "not a query result" in one_line(result.stderr)


def test_an_agent_nested_too_deep_is_its_own_row(kvctl) -> None:
    deep = Answer(b"[" * 100_000 + b"]" * 100_000, JSON)
    routes = {"/a/healthz": deep, "/a/v1/pools": deep, "/a/v1/alerts": deep}
    routes["/ok/metrics"] = answer(VLLM_TEXT)
    with HostileServer(routes) as server:
        result = kvctl("status", "--agent", f"{server.url}/a", "--agent", f"vllm+{server.url}/ok")
    assert result.exit_code == ExitCode.UNREACHABLE
    assert f"deeper than {MAX_JSON_DEPTH} levels" in one_line(result.stderr)
    assert "smollm" in result.stdout


# ---- NaN and ±Inf ---------------------------------------------------------------------------


def test_nan_and_inf_are_dashes_with_notes_beside_a_healthy_node(kvctl) -> None:
    nan = spoiled(VLLM_TEXT, "vllm:num_requests_running", "NaN")
    nan = spoiled(nan, "vllm:kv_cache_usage_perc", "NaN")
    inf = spoiled(VLLM_TEXT, "vllm:num_requests_waiting", "+Inf")
    inf = re.sub(r'num_gpu_blocks="\d+"', 'num_gpu_blocks="+Inf"', inf)
    routes = {"/nan/metrics": answer(nan), "/inf/metrics": answer(inf)}
    routes["/ok/metrics"] = answer(VLLM_TEXT)
    with HostileServer(routes) as server:
        nodes = [f"vllm+{server.url}/{name}" for name in ("nan", "inf", "ok")]
        args = [arg for node in nodes for arg in ("--agent", node)]
        result = kvctl("status", "--json", *args)
        table = kvctl("status", *args)
    assert result.exit_code == ExitCode.OK, result.output
    bad_nan, bad_inf, ok = json.loads(result.stdout)["agents"]
    assert bad_nan["up"] and bad_nan["figures"]["requests_running"] is None
    assert bad_nan["figures"]["utilization_ratio"] is None
    assert any("NaN" in note and "requests running" in note for note in bad_nan["notes"])
    assert bad_inf["figures"]["requests_waiting"] is None
    assert bad_inf["figures"]["blocks"] is None and bad_inf["figures"]["capacity_tokens"] is None
    assert sum("+Inf" in note for note in bad_inf["notes"]) == 2
    assert ok["figures"]["requests_running"] == 2 and ok["figures"]["blocks"] == 40
    assert table.exit_code == ExitCode.OK and table.stdout.count("smollm") == 3


def test_one_node_failing_to_read_leaves_the_others_their_rows(kvctl, monkeypatch) -> None:
    real = fleet.engine_rows

    def rows(engine, exposition):
        if any(s.labels.get("model_name") == "broken" for s in exposition.series(engine.marker)):
            raise OverflowError("cannot convert float infinity to integer")
        return real(engine, exposition)

    monkeypatch.setattr(fleet, "engine_rows", rows)
    broken = VLLM_TEXT.replace('model_name="smollm"', 'model_name="broken"')
    routes = {"/bad/metrics": answer(broken), "/ok/metrics": answer(VLLM_TEXT)}
    with HostileServer(routes) as server:
        result = kvctl(
            "status", "--agent", f"vllm+{server.url}/bad", "--agent", f"vllm+{server.url}/ok"
        )
    assert result.exit_code == ExitCode.ERROR
    assert "cannot convert float infinity" in one_line(result.stderr)
    assert "smollm" in result.stdout


def test_prometheus_nonsense_is_a_dash_with_a_note() -> None:
    from kvctl.prometheus_fleet import ENGINE_LABEL, MODEL_LABEL, Series, build_readings

    def labels(instance: str, **more: str) -> dict[str, str]:
        return {"job": "j", "instance": instance, MODEL_LABEL: "m", ENGINE_LABEL: "vllm", **more}

    info = {"model_name": "m", "block_size": "16", "num_gpu_blocks": "+Inf"}
    readings = build_readings(
        {
            "running": [Series(labels("bad:1"), -3.0), Series(labels("ok:1"), 2.0)],
            "util": [Series(labels("bad:1"), 4.5), Series(labels("ok:1"), 0.5)],
            "info:vllm": [Series({"job": "j", "instance": "bad:1", **info}, 1.0)],
        }
    )
    bad, ok = readings
    assert bad.up and bad.figures is not None and ok.figures is not None
    assert (bad.figures.requests_running, bad.figures.utilization_ratio) == (None, None)
    assert (bad.figures.blocks, bad.figures.block_tokens) == (None, 16)
    said = " ".join(bad.notes)
    assert "-3, below zero" in said and "4.5, outside 0..1" in said and "+Inf" in said
    assert (ok.figures.requests_running, ok.figures.utilization_ratio) == (2, 0.5)


# ---- reading in linear time and bounded memory ----------------------------------------------


class CountingLabels(dict):
    """Labels that count how often a label is looked up, across every sample."""

    looked_up = 0

    def get(self, key, default=None):
        CountingLabels.looked_up += 1
        return super().get(key, default)


def test_each_models_row_reads_its_own_samples_only() -> None:
    models = 300
    names = [
        VLLM.running,
        VLLM.waiting,
        VLLM.utilization,
        VLLM.preemptions,
        VLLM.prefix.hits,
        VLLM.prefix.queries,
    ]
    samples = [
        Sample(name, CountingLabels(model_name=f"m{i}"), 1.0)
        for name in names
        for i in range(models)
        if name
    ]
    CountingLabels.looked_up = 0
    rows = engine_rows(VLLM, Exposition(samples))
    assert len(rows) == models
    assert CountingLabels.looked_up <= 3 * len(samples)  # not once per sample per model


def test_series_no_engine_reads_are_dropped_as_they_are_parsed() -> None:
    text = VLLM_TEXT + "".join(f'unrelated_bucket{{le="{i}"}} {i}\n' for i in range(100))
    exposition = Exposition.parse(text)
    assert "unrelated_bucket" not in exposition and "vllm:num_requests_running" in exposition
    assert "python_gc_objects_collected_total" not in exposition
    assert {name for name in READ_SERIES if name in exposition} >= {VLLM.marker}


def test_chunks_split_anywhere_read_as_the_whole_text() -> None:
    data = VLLM_TEXT.encode()
    whole = engine_rows(VLLM, Exposition.parse(VLLM_TEXT))
    for size in (1, 7, 100, 4096):
        reader = ExpositionReader()
        for start in range(0, len(data), size):
            reader.feed(data[start : start + size])
        assert engine_rows(VLLM, reader.close()) == whole


def test_not_an_exposition_is_still_refused() -> None:
    from kvctl.exposition import ExpositionError

    for text in ('{"detail": "Not Found"}', "[]", "<!doctype html>\n<html></html>"):
        with pytest.raises(ExpositionError, match="not a Prometheus exposition"):
            Exposition.parse(text)


def test_the_figures_of_a_real_exposition_are_unchanged() -> None:
    (row,) = engine_rows(VLLM, Exposition.parse(VLLM_TEXT))
    assert row.notes == ()
    assert (row.figures.block_tokens, row.figures.blocks, row.figures.capacity_tokens) == (
        32,
        40,
        1280,
    )
