"""The real `kvctl-agent` process over real HTTP: completions, streaming, pool stats, defrag,
resize, config, metrics, bad input, auth, the public-bind refusal and SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from agent_process import refused_at_start
from prometheus_client.parser import text_string_to_metric_families

from kvctl.api import CompletionResponse, DefragResult, PoolMap, PoolSnapshot, ResizeResult

pytestmark = pytest.mark.integration

GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def client(agent, token: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=agent.url, headers=headers, timeout=60)


def idle_map(http: httpx.Client, timeout: float = 30.0, idle: bool = True) -> PoolMap:
    """The page map with its snapshot of the same moment, once no request runs or waits (other
    tests' requests on the shared agent may still be finishing); at once with `idle=False`."""
    deadline = time.monotonic() + timeout
    while True:
        page_map = PoolMap.model_validate(http.get("/v1/pool/map").json())
        assert page_map.pool is not None
        if not idle or page_map.pool.requests_running == page_map.pool.requests_waiting == 0:
            return page_map
        assert time.monotonic() < deadline, "the agent did not become idle"
        time.sleep(0.05)


def pool_state(http: httpx.Client, idle: bool = True) -> tuple:
    """What must not change when a request is refused: capacity, page map and counters, read
    once the agent is idle (or at once, with `idle=False`)."""
    page_map = idle_map(http, idle=idle)
    snapshot = page_map.pool
    assert snapshot is not None
    return (
        snapshot.capacity_pages,
        snapshot.alloc_attempts_total,
        snapshot.defrag_pages_moved_total,
        snapshot.resizes_total,
        page_map.runs,
        http.get("/v1/config").json(),
    )


def test_health_and_models(agent) -> None:
    with client(agent) as http:
        assert http.get("/healthz").json()["status"] == "ok"
        models = http.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["demo"]


def test_completion_text_and_token_ids(agent) -> None:
    with client(agent) as http:
        body = {"prompt": "The pool is cut into pages", **GREEDY, "return_token_ids": True}
        first = CompletionResponse.model_validate(http.post("/v1/completions", json=body).json())
        choice = first.choices[0]
        assert choice.finish_reason == "length" and len(choice.token_ids) == 12
        assert first.usage.completion_tokens == 12 and first.usage.prompt_tokens == 27
        # the same prompt as token ids gives the same tokens
        ids = [256, *b"The pool is cut into pages"]
        again = http.post("/v1/completions", json={**body, "prompt": ids}).json()
        assert again["choices"][0]["token_ids"] == choice.token_ids
        assert again["choices"][0]["text"] == choice.text


def test_streaming_adds_up_to_the_plain_completion(agent) -> None:
    body = {"prompt": "Stream me", **GREEDY}
    with client(agent) as http:
        plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        chunks = []
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == plain
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 12


def test_pool_stats_move_and_defrag_and_resize_work(start_agent) -> None:
    agent = start_agent("--pool-pages", "64", "--segment-pages", "16", "--page-size", "4")
    with client(agent) as http:
        before = PoolSnapshot.model_validate(http.get("/v1/pool").json())
        assert before.capacity_pages == 64 and before.alloc_attempts_total == 0
        for i in range(3):
            http.post("/v1/completions", json={"prompt": "x" * (10 + 7 * i), **GREEDY})
        after = PoolSnapshot.model_validate(http.get("/v1/pool").json())
        assert after.alloc_attempts_total > 0 and after.alloc_success_ratio == 1.0
        report = DefragResult.model_validate(http.post("/v1/defrag", json={}).json())
        assert report.fragmentation_after == 0.0 and report.complete
        grown = ResizeResult.model_validate(http.post("/v1/pool/resize", json={"pages": 80}).json())
        assert (grown.old_pages, grown.new_pages, grown.direction) == (64, 80, "grow")
        by_bytes = http.post("/v1/pool/resize", json={"bytes": 32 * after.bytes_per_page}).json()
        assert (by_bytes["new_pages"], by_bytes["direction"]) == (32, "shrink")
        snapshot = PoolSnapshot.model_validate(http.get("/v1/pool").json())
        assert snapshot.capacity_pages == 32
        assert snapshot.resizes_total == {"grow": 1, "shrink": 1}
        assert snapshot.defrag_runs_total["manual"] == 1


@pytest.mark.slow
def test_refused_resize_is_409_and_changes_nothing(start_agent) -> None:
    # pages of one token: the 1,000-token request below runs for seconds on the demo model
    agent = start_agent("--pool-pages", "2048", "--segment-pages", "256", "--page-size", "1")
    long_request = {"prompt": "y" * 60, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with (
        client(agent) as http,
        httpx.Client(base_url=agent.url, timeout=60) as other,
        other.stream("POST", "/v1/completions", json=long_request) as response,
    ):
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        state = pool_state(http, idle=False)  # the request runs: that is what refuses
        refused = http.post("/v1/pool/resize", json={"pages": 512})
        assert refused.status_code == 409
        message = refused.json()["error"]["message"]
        assert "an admitted request may need 1,061 pages to finish" in message
        assert "choose a size of at least 1,280 pages" in message
        assert pool_state(http, idle=False)[0] == state[0]
        for _ in lines:
            pass


def test_metrics_parse_and_follow_the_pool(agent) -> None:
    import time

    pool = (("pool", "demo"),)
    with client(agent) as http:
        http.post("/v1/completions", json={"prompt": "metrics", **GREEDY})
        deadline = time.monotonic() + 10
        while True:  # the snapshot a scrape reads is at most 100 ms old
            text = http.get("/metrics").text
            snapshot = PoolSnapshot.model_validate(http.get("/v1/pool").json())
            samples = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
            }
            if samples[("kvctl_alloc_attempts_total", pool)] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert samples[("kvctl_pool_capacity_pages", pool)] == snapshot.capacity_pages
    assert samples[("kvctl_alloc_attempts_total", pool)] >= 1
    assert not any(name.endswith("_created") for name, _ in samples)
    assert not any(name.startswith("kvctl_gpu_") for name, _ in samples)  # no NVML here


def _serving_samples(http: httpx.Client) -> dict[str, float]:
    """The serving series of one scrape, by name (the pool label dropped)."""
    wanted = (
        "kvctl_time_to_first_token_seconds_count",
        "kvctl_time_to_first_token_seconds_sum",
        "kvctl_inter_token_latency_seconds_count",
        "kvctl_request_latency_seconds_count",
        "kvctl_request_latency_seconds_sum",
        "kvctl_request_queue_time_seconds_count",
        "kvctl_prompt_tokens_total",
        "kvctl_generation_tokens_total",
    )
    return {
        s.name: s.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for s in family.samples
        if s.name in wanted
    }


def test_serving_latencies_and_token_counts_follow_the_requests(agent) -> None:
    """Three greedy 12-token requests: one first token, 11 gaps, one end and one admission
    each, and the token counters move by the usage the agent reported."""
    import time

    with client(agent) as http:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # requests other tests left behind must end first
            pool = http.get("/v1/pool").json()
            if not pool["requests_running"] and not pool["requests_waiting"]:
                break
            time.sleep(0.1)
        time.sleep(0.3)  # and their last events go out
        before = _serving_samples(http)
        usages = [
            http.post("/v1/completions", json={"prompt": f"serve {i}", **GREEDY}).json()["usage"]
            for i in range(3)
        ]
        prompt = sum(u["prompt_tokens"] for u in usages)
        generated = sum(u["completion_tokens"] for u in usages)
        assert generated == 36
        deadline = time.monotonic() + 10
        while True:  # the token counters come with the snapshot, at most 100 ms old
            after = _serving_samples(http)
            moved = after["kvctl_generation_tokens_total"] - before["kvctl_generation_tokens_total"]
            if moved >= generated or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["kvctl_time_to_first_token_seconds_count"] == 3
    assert delta["kvctl_inter_token_latency_seconds_count"] == 33
    assert delta["kvctl_request_latency_seconds_count"] == 3
    assert delta["kvctl_request_queue_time_seconds_count"] == 3
    assert delta["kvctl_prompt_tokens_total"] == prompt
    assert delta["kvctl_generation_tokens_total"] == generated
    ttft, whole = (
        delta["kvctl_time_to_first_token_seconds_sum"],
        delta["kvctl_request_latency_seconds_sum"],
    )
    assert 0 < ttft <= whole


def test_the_map_comes_with_the_pool_of_the_same_moment(agent) -> None:
    """Under load, the page counts of the map and of its snapshot agree exactly."""
    body = {"prompt": "consistent " * 40, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with client(agent) as http, ThreadPoolExecutor(4) as pool:
        running = [pool.submit(http.post, "/v1/completions", json=body) for _ in range(4)]
        for _ in range(20):
            page_map = PoolMap.model_validate(http.get("/v1/pool/map").json())
            assert page_map.pool is not None
            used = sum(length for state, _, length in page_map.runs if state == "used")
            cached = sum(length for state, _, length in page_map.runs if state == "cached")
            assert (used, cached) == (page_map.pool.used_pages, page_map.pool.cached_pages)
            assert page_map.pool.capacity_pages == page_map.capacity_pages
        assert all(r.result().status_code == 200 for r in running)


def test_runtime_config_patch(agent) -> None:
    with client(agent) as http:
        original = http.get("/v1/config").json()
        changed = http.patch("/v1/config", json={"defrag": {"fragmentation_threshold": 0.7}})
        assert changed.status_code == 200
        assert changed.json()["defrag"]["fragmentation_threshold"] == 0.7
        assert http.get("/v1/config").json()["defrag"]["fragmentation_threshold"] == 0.7
        restored = http.patch("/v1/config", json={"defrag": original["defrag"]})
        assert restored.json() == original


@pytest.mark.slow
def test_config_shows_the_limits_in_force_and_null_restores_them(start_agent) -> None:
    agent = start_agent("--pool-pages", "256", "--segment-pages", "32", "--max-pool-pages", "1024")
    with client(agent) as http:
        resize = http.get("/v1/config").json()["resize"]
        assert (resize["min_pages"], resize["max_pages"]) == (32, 1024)
        lowered = {"resize": {"min_pages": 64, "max_pages": 512}}
        assert http.patch("/v1/config", json=lowered).json()["resize"]["max_pages"] == 512
        assert http.post("/v1/pool/resize", json={"pages": 1024}).status_code == 409
        assert http.post("/v1/pool/resize", json={"pages": 32}).status_code == 409
        back = http.patch("/v1/config", json={"resize": {"min_pages": None, "max_pages": None}})
        assert (back.json()["resize"]["min_pages"], back.json()["resize"]["max_pages"]) == (
            32,
            1024,
        )
        assert http.post("/v1/pool/resize", json={"pages": 32}).json()["new_pages"] == 32
        assert http.post("/v1/pool/resize", json={"pages": 1024}).json()["new_pages"] == 1024


def test_concurrent_patches_are_applied_one_after_another(agent) -> None:
    """Twenty clients each change a different setting at once: every change is in force."""
    names = ["fragmentation_threshold", "fragmentation_target", "check_interval_s"]
    values = {
        ("defrag", "max_free_extents"): 100,
        ("defrag", "min_free_pages"): 20,
        ("defrag", "step_max_pages"): 80,
        ("alerts", "prefix_hit_min"): 0.2,
        ("alerts", "fragmentation_max"): 0.6,
        ("alerts", "preemptions_per_minute_max"): 40.0,
        ("resize", "window_s"): 90.0,
        ("defrag", "on_contiguous_miss"): False,
    }
    with client(agent) as http:
        original = http.get("/v1/config").json()
        barrier = threading.Barrier(len(values))

        def patch(key: tuple[str, str], value: object) -> int:
            with client(agent) as own:
                barrier.wait()
                return own.patch("/v1/config", json={key[0]: {key[1]: value}}).status_code

        with ThreadPoolExecutor(len(values)) as pool:
            codes = list(pool.map(patch, values, values.values()))
        assert codes == [200] * len(values)
        final = http.get("/v1/config").json()
        assert {key: final[key[0]][key[1]] for key in values} == values
        assert all(final["defrag"][n] == original["defrag"][n] for n in names)
        restore = {section: original[section] for section in ("defrag", "alerts", "resize")}
        assert http.patch("/v1/config", json=restore).json() == original


BAD_BODIES = [
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**9}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 8.0}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": True}),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}),
    ("POST", "/v1/completions", {"prompt": "x", "bogus": 1}),
    ("POST", "/v1/completions", {"prompt": [1, -5]}),
    ("POST", "/v1/completions", {"prompt": [1, 99999]}),
    ("POST", "/v1/completions", {"prompt": []}),
    ("POST", "/v1/completions", {"prompt": "x" * 9000}),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-9"}),
    ("POST", "/v1/completions", {"prompt": "x", "n": 17}),
    ("POST", "/v1/completions", {"prompt": "x", "stop": ["a"] * 17}),
    ("POST", "/v1/completions", {"prompt": "x", "stop": [""]}),
    ("POST", "/v1/completions", {}),
    ("POST", "/v1/defrag", {"max_pages": 0}),
    ("POST", "/v1/defrag", {"max_pages": "all"}),
    ("POST", "/v1/defrag", {"max_pages": True}),
    ("POST", "/v1/defrag", {"pages": 3}),
    ("POST", "/v1/pool/resize", {}),
    ("POST", "/v1/pool/resize", {"pages": 16, "bytes": 1024}),
    ("POST", "/v1/pool/resize", {"pages": -16}),
    ("POST", "/v1/pool/resize", {"pages": 10**15}),
    ("POST", "/v1/pool/resize", {"pages": 1.5}),
    ("POST", "/v1/pool/resize", {"pages": 256.0}),
    ("POST", "/v1/pool/resize", {"pages": True}),
    ("POST", "/v1/pool/resize", {"pages": 100000}),
    ("PATCH", "/v1/config", {"defrag": {"fragmentation_threshold": 2}}),
    ("PATCH", "/v1/config", {"defrag": {"nonsense": True}}),
    ("PATCH", "/v1/config", {"defrag": {"enabled": 1}}),
    ("PATCH", "/v1/config", {"defrag": {"step_max_pages": 64.0}}),
    ("PATCH", "/v1/config", {"defrag": "off"}),
    ("PATCH", "/v1/config", {"resize": {"low_water": 0.9, "high_water": 0.5}}),
    ("PATCH", "/v1/config", {"resize": {"max_pages": 2048}}),
    ("PATCH", "/v1/config", {"resize": {"min_pages": 1e30}}),
    ("PATCH", "/v1/config", {"resize": {"min_pages": 4096}}),
    ("PATCH", "/v1/config", {"resize": {"enabled": "yes"}}),
    ("PATCH", "/v1/config", {"alerts": {"interval_s": 1e-9}}),
    ("PATCH", "/v1/config", {"tuning": {}}),
    ("PATCH", "/v1/config", ["defrag"]),
    ("PATCH", "/v1/config", {"prefix_cache": {"eviction_policy": "random"}}),
]


@pytest.mark.parametrize(("method", "path", "body"), BAD_BODIES)
def test_bad_input_is_a_4xx_json_error_and_changes_nothing(agent, method, path, body) -> None:
    with client(agent) as http:
        # compact first, so an idle-time auto-defrag cannot move pages during the comparison
        idle_map(http)
        assert http.post("/v1/defrag", json={}).status_code == 200
        before = pool_state(http)
        response = http.request(method, path, json=body)
        assert 400 <= response.status_code < 500, response.text
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"]
        assert "\n" not in error["message"]
        assert pool_state(http) == before


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            b'{"resize": {"max_pages": 2048}}',
            "resize.max_pages: must be at most 1024, the --max-pool-pages the agent was started",
        ),
        (
            b'{"resize": {"min_pages": 1e30}}',
            "resize.min_pages: must be a whole number of pages in [1, 1099511627776], or null "
            "for the default, got 1e+30",
        ),
        (
            b'{"alerts": {"interval_s": 1e-9}}',
            "alerts.interval_s: must be a number of seconds in [1, 3600], got 1e-09",
        ),
        (
            b'{"alerts": {"interval_s": 1e999}}',
            "alerts.interval_s: must be a number of seconds in [1, 3600], got Infinity",
        ),
        (b'{"defrag": {"enabled": 1}}', "defrag.enabled: must be true or false, got 1"),
        (b'{"defrag": {"nonsense": 1}}', "defrag.nonsense: unknown setting; defrag has enabled"),
        (b'{"resize": {"low_water": 0.95}}', "resize.low_water: must be below resize.high_water"),
    ],
)
def test_a_refused_patch_names_the_key_and_the_allowed_range(agent, body, message) -> None:
    with client(agent) as http:
        before = http.get("/v1/config").json()
        response = http.patch(
            "/v1/config", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 422
        assert response.json()["error"]["message"].startswith(message)
        assert http.get("/v1/config").json() == before


def test_malformed_json_and_oversized_bodies(agent) -> None:
    with client(agent) as http:
        response = http.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert (
            response.status_code == 422 and "not valid JSON" in response.json()["error"]["message"]
        )
        huge = http.post("/v1/completions", json={"prompt": "x" * (2 << 20)})
        assert huge.status_code == 413


@pytest.mark.slow
def test_the_token_guards_every_endpoint_but_health_and_the_runbook(start_agent) -> None:
    agent = start_agent(*("--pool-pages", "64", "--segment-pages", "16"), token="s3cret")
    with (
        client(agent) as anonymous,
        client(agent, "wrong") as wrong,
        client(agent, "s3cret") as right,
    ):
        assert anonymous.get("/healthz").status_code == 200
        assert anonymous.get("/runbook").status_code == 200
        for http in (anonymous, wrong):
            for path in ("/v1/pool", "/v1/pool/map", "/metrics", "/v1/config", "/openapi.json"):
                response = http.get(path)
                assert response.status_code == 401, path
                assert "token" in response.json()["error"]["message"]
            assert http.post("/v1/defrag", json={}).status_code == 401
            assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 401
            assert http.patch("/v1/config", json={}).status_code == 401
            assert http.post("/v1/pools/demo/sleep", json={"force": True}).status_code == 401
            assert http.post("/v1/pools/demo/wake").status_code == 401
        assert right.get("/v1/pool").json()["sleep"]["state"] == "awake"
        assert right.get("/metrics").status_code == 200
        assert right.get("/v1/pool").status_code == 200
        assert right.post("/v1/defrag", json={}).status_code == 200
        assert (
            right.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        )


def test_public_bind_without_token_is_refused() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvctl.agent.startup.main", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2
    assert "refusing to listen on 0.0.0.0 without a token" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pool-pages", "8", "--pool-memory", "1GiB"], "give one of"),
        (["--pool-memory", "lots"], "cannot read 'lots' as a size"),
        (["--model", "/nonexistent/checkpoint"], "/nonexistent/checkpoint"),
        (["--alert-interval", "soon"], "alerts.interval_s: must be a number of seconds in"),
        (["--set", "defrag.enabled=maybe"], "defrag.enabled: must be true or false"),
        (["--set", "defrag.bogus=1"], "defrag.bogus: unknown setting"),
        (
            ["--pool-pages", "64", "--max-pool-pages", "64", "--set", "resize.max_pages=128"],
            "resize.max_pages: must be at most 64",
        ),
        (["--max-pool-pages", "64"], "initial size of 1024 pages is above --max-pool-pages 64"),
        (["--advertise-url", "http://0.0.0.0:8477"], "wildcard address"),
        (["--device", "tpu"], "cpu, cuda or cuda:N"),
        (["--host-tier-memory", "1000TiB"], "the host tier would take 1000 TiB more"),
        (["--disk-tier-path", "/proc/version"], "exists and is not a directory"),
        (["--disk-tier-size", "1GiB"], "--disk-tier-size needs --disk-tier-path"),
        (["--no-prefix-cache", "--host-tier-memory", "1GiB"], "they need the prefix cache"),
    ],
)
def test_bad_flags_are_one_line_errors(flags, message) -> None:
    assert message in refused_at_start(*flags)


@pytest.mark.slow
def test_sigterm_exits_cleanly(start_agent) -> None:
    agent = start_agent("--pool-pages", "64", "--segment-pages", "16")
    with client(agent) as http:
        assert http.get("/healthz").status_code == 200
    assert agent.stop() == 0
