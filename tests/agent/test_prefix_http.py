"""Prefix operations over HTTP and the CLI against a real agent process: a lookup finds what a
request cached, a pin holds it through a flood that evicts everything else, pins show in the
snapshot, the metrics and the audit log, a clear purges one salt; bad input and refusals are one
line that changes nothing; the token guards every prefix route. And `kvctl prefix clear` on a
vLLM server pulls vLLM's own reset (tests/engine_lever_server.py, a recorded fake)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from engine_lever_server import EngineState, LeverServer

pytestmark = pytest.mark.integration

SYSTEM = "You are the on-call assistant. Answer with the command that fixes the node. " * 2
POOL = ("--pool-pages", "64", "--segment-pages", "16")


def client(agent, token: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=agent.url, headers=headers, timeout=60)


def complete(http: httpx.Client, prompt: str, salt: str | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def snapshot(http: httpx.Client) -> dict:
    return http.get("/v1/pool").json()


def fresh_snapshot(http: httpx.Client, **expected: int) -> dict:
    """The snapshot once it shows `expected` (it is published every 100 ms)."""
    deadline = time.monotonic() + 10
    while True:
        body = snapshot(http)
        if all(body[k] == v for k, v in expected.items()) or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def test_lookup_pin_flood_and_clear_over_http(start_agent, kvctl) -> None:
    agent = start_agent(*POOL, "--report-cached-tokens")
    with client(agent) as http:
        complete(http, SYSTEM + "Q1", salt="team-a")
        found = http.post("/v1/prefix/lookup", json={"prompt": SYSTEM, "cache_salt": "team-a"})
        assert found.status_code == 200, found.text
        cached = found.json()["device_tokens"]
        assert cached >= 16 and found.json()["pins"] == []
        other = http.post("/v1/prefix/lookup", json={"prompt": SYSTEM, "cache_salt": "team-b"})
        assert other.json()["device_tokens"] == 0

        pinned = http.post(
            "/v1/prefix/pins", json={"prompt": SYSTEM, "cache_salt": "team-a", "ttl_s": 600}
        )
        assert pinned.status_code == 201, pinned.text
        pin = pinned.json()
        assert pin["tokens"] == cached // 16 * 16 and pin["expires_at"] is not None
        body = fresh_snapshot(http, prefix_pins=1)
        assert body["prefix_pinned_pages"] == pin["pages"] and body["prefix_pin_cap_pages"] == 16
        metrics = http.get("/metrics").text
        assert f'kvctl_prefix_pinned_pages{{pool="demo"}} {float(pin["pages"])}' in metrics

        for i in range(12):  # a flood of unique prompts: every unpinned page is evicted
            complete(http, f"{i} unrelated prompt " * 20, salt="flood")
        assert snapshot(http)["prefix_evictions_total"] > 0
        again = http.post("/v1/prefix/lookup", json={"prompt": SYSTEM, "cache_salt": "team-a"})
        assert again.json()["device_tokens"] >= pin["tokens"]
        assert again.json()["pins"] == [pin["id"]]
        reply = complete(http, SYSTEM + "Q2", salt="team-a")
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= pin["tokens"]
        residency = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in http.get("/metrics").text.splitlines()
            if line.startswith(("kvctl_prefix_", "kvctl_pool_token")) and " " in line
        }
        assert residency['kvctl_prefix_page_lifetime_seconds_count{pool="demo"}'] > 0
        assert residency['kvctl_prefix_page_idle_before_eviction_seconds_count{pool="demo"}'] > 0
        assert residency['kvctl_prefix_reuse_gap_seconds_count{pool="demo"}'] >= 1
        by_reason = 'kvctl_prefix_evicted_pages_by_reason_total{pool="demo",reason="allocation"}'
        assert residency[by_reason] > 0

        listed = http.get("/v1/prefix").json()
        assert [p["id"] for p in listed["pins"]] == [pin["id"]]
        assert listed["prefixes"] and listed["prefixes"][0]["tokens"] >= pin["tokens"]

        cleared = http.post("/v1/prefix/clear", json={"cache_salt": "team-a"})
        assert cleared.status_code == 200, cleared.text
        assert cleared.json()["pins_removed"] == [pin["id"]]
        assert cleared.json()["pages_freed"]["device"] >= pin["pages"]
        after = http.post("/v1/prefix/lookup", json={"prompt": SYSTEM, "cache_salt": "team-a"})
        assert after.json()["device_tokens"] == 0
        assert fresh_snapshot(http, prefix_pins=0)["prefix_pinned_pages"] == 0
    log = "\n".join(agent.log)
    for action in ("prefix_pin", "prefix_clear"):
        assert f"audit action={action} outcome=ok" in log


def test_refusals_are_one_line_and_change_nothing(start_agent) -> None:
    agent = start_agent(*POOL)
    with client(agent) as http:
        complete(http, SYSTEM, salt="team-a")
        settled = fresh_snapshot(http, used_pages=0)
        time.sleep(0.2)  # the snapshot after the request's end is published
        before = (snapshot(http)["used_pages"], snapshot(http)["cached_pages"])
        assert before[1] > 0 and settled["requests_running"] == 0
        cases = [
            ("/v1/prefix/lookup", {"prompt": "x", "token_ids": [1]}, 422, "exactly one"),
            ("/v1/prefix/lookup", {}, 422, "exactly one"),
            ("/v1/prefix/lookup", {"token_ids": [-1]}, 422, "token_ids"),
            ("/v1/prefix/lookup", {"token_ids": [10**6]}, 400, "token_ids"),
            ("/v1/prefix/lookup", {"prompt": "x", "model": "nope"}, 404, "nope"),
            ("/v1/prefix/pins", {"prompt": "x", "ttl_s": 0}, 422, "ttl_s"),
            ("/v1/prefix/pins", {"prompt": "never sent before at all"}, 409, "nothing of this"),
            ("/v1/prefix/clear", {"cache_salt": "unknown"}, 404, "unknown"),
            ("/v1/prefix/clear", {"tier": "host"}, 409, "no host tier"),
            ("/v1/prefix/clear", {"tier": "gpu"}, 422, "tier"),
        ]
        for path, body, status, words in cases:
            response = http.post(path, json=body)
            assert response.status_code == status, (path, body, response.text)
            message = response.json()["error"]["message"]
            assert words in message and "\n" not in message, message
        assert http.delete("/v1/prefix/pins/pin-none").status_code == 404
        patch = {"prefix_cache": {"max_pinned_share": 0.01}}
        assert http.patch("/v1/config", json=patch).status_code == 200
        over = http.post("/v1/prefix/pins", json={"prompt": SYSTEM, "cache_salt": "team-a"})
        assert over.status_code == 409 and "above the cap" in over.json()["error"]["message"]
        assert (snapshot(http)["used_pages"], snapshot(http)["cached_pages"]) == before
        assert snapshot(http)["prefix_pins"] == 0
    assert "audit action=prefix_pin outcome=refused" in "\n".join(agent.log)


@pytest.mark.slow
def test_the_token_guards_the_prefix_routes(start_agent) -> None:
    agent = start_agent(*POOL, token="s3cret")
    with client(agent) as anonymous, client(agent, "s3cret") as right:
        assert anonymous.get("/v1/prefix").status_code == 401
        assert anonymous.post("/v1/prefix/lookup", json={"prompt": "x"}).status_code == 401
        assert anonymous.post("/v1/prefix/pins", json={"prompt": "x"}).status_code == 401
        assert anonymous.delete("/v1/prefix/pins/pin-1").status_code == 401
        assert anonymous.post("/v1/prefix/clear", json={}).status_code == 401
        assert right.get("/v1/prefix").status_code == 200
    assert "audit action=prefix_clear outcome=unauthorized" in "\n".join(agent.log)


def test_the_cli_looks_up_pins_with_warm_lists_and_clears(start_agent, kvctl) -> None:
    agent = start_agent(*POOL)
    at = ("--agent", agent.url)
    warm = kvctl("prefix", "pin", SYSTEM, "--salt", "t1", "--warm", "--ttl", "10m", *at)
    assert warm.exit_code == 0, warm.stderr
    assert "pinned pin-" in warm.stdout and "cache salt t1" in warm.stdout
    looked = kvctl("prefix", "lookup", SYSTEM, "--salt", "t1", "--json", *at)
    assert looked.exit_code == 0, looked.stderr
    result = json.loads(looked.stdout)
    assert result["device_tokens"] >= 16 and len(result["pins"]) == 1
    shown = kvctl("pool", "show", *at)
    assert shown.exit_code == 0, shown.stderr
    assert "of the token slots hold K/V" in shown.stdout and "residency" in shown.stdout
    listed = kvctl("prefix", "ls", *at)
    assert result["pins"][0] in listed.stdout and "largest cached prefixes" in listed.stdout
    both = kvctl("prefix", "lookup", "x", "--token-ids", "1,2", *at)
    assert both.exit_code == 2 and "give the prompt once" in both.stderr
    bad_ttl = kvctl("prefix", "pin", "x", "--ttl", "soon", *at)
    assert bad_ttl.exit_code == 2 and "--ttl" in bad_ttl.stderr
    unknown = kvctl("prefix", "clear", "--salt", "nobody", "--yes", *at)
    assert unknown.exit_code != 0 and "nobody" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1
    cancelled = kvctl("prefix", "clear", *at, input="n\n")
    assert cancelled.exit_code != 0 and "nothing changed" in cancelled.stderr
    cleared = kvctl("prefix", "clear", "--salt", "t1", "--yes", *at)
    assert cleared.exit_code == 0, cleared.stderr
    assert "1 pins removed" in cleared.stdout
    unpin = kvctl("prefix", "unpin", result["pins"][0], *at)
    assert unpin.exit_code != 0 and "no pin" in unpin.stderr


def test_prefix_clear_on_a_vllm_server_pulls_its_reset(kvctl) -> None:
    with LeverServer(EngineState()) as server:
        done = kvctl("prefix", "clear", "--yes", "--agent", server.agent)
        assert done.exit_code == 0, done.stderr
        assert "prefix cache cleared" in done.stdout
        assert server.state.sent == [("POST", "/reset_prefix_cache")]
        narrowed = kvctl("prefix", "clear", "--salt", "a", "--yes", "--agent", server.agent)
        assert narrowed.exit_code == 2 and "whole prefix cache" in narrowed.stderr
        assert server.state.sent == [("POST", "/reset_prefix_cache")]
    with LeverServer(EngineState(dev_mode=False)) as server:
        off = kvctl("prefix", "clear", "--yes", "--agent", server.agent)
        assert off.exit_code != 0 and "VLLM_SERVER_DEV_MODE" in off.stderr


def test_move_stores_a_copy_below_and_brings_a_prefix_back(start_agent, kvctl) -> None:
    agent = start_agent(*POOL, "--host-tier-memory", "32MiB")
    at = ("--agent", agent.url)
    with client(agent) as http:
        missing = http.post("/v1/prefix/move", json={"prompt": SYSTEM, "to": "host"})
        assert missing.status_code == 409 and "nothing of this" in missing.text
        no_disk = http.post("/v1/prefix/move", json={"prompt": SYSTEM, "to": "disk"})
        assert no_disk.status_code == 409 and "no disk tier" in no_disk.text
        warmed = http.post("/v1/prefix/move", json={"prompt": SYSTEM, "to": "device"})
        assert warmed.status_code == 200, warmed.text
        assert warmed.json()["device_tokens"] >= 16 and warmed.json()["tier_tokens"]["host"] == 0
    stored = kvctl("prefix", "move", SYSTEM, "--to", "host", "--json", *at)
    assert stored.exit_code == 0, stored.stderr
    host = json.loads(stored.stdout)["tier_tokens"]["host"]
    assert host >= 16 and host % 16 == 0
    cleared = kvctl("prefix", "clear", "--tier", "device", "--yes", *at)
    assert cleared.exit_code == 0, cleared.stderr
    back = kvctl("prefix", "move", SYSTEM, "--to", "device", "--json", *at)
    assert back.exit_code == 0, back.stderr
    assert json.loads(back.stdout)["device_tokens"] >= host
    with client(agent) as http:
        by_tier = snapshot(http)["prefix_hits_tokens_by_tier"]
        assert by_tier["host"] >= host  # the device got it back from the host tier
    assert "audit action=prefix_move outcome=ok" in "\n".join(agent.log)


def test_a_warm_pin_whose_client_vanishes_aborts_its_request(start_agent) -> None:
    agent = start_agent("--pool-pages", "256", "--segment-pages", "32")
    long = "The system prompt of a tenant who leaves before it is computed. " * 40
    with pytest.raises(httpx.TimeoutException), client(agent) as http:
        http.post("/v1/prefix/pins", json={"prompt": long, "warm": True}, timeout=0.05)
    with client(agent) as http:
        deadline = time.monotonic() + 10
        while True:
            finished = snapshot(http)["requests_finished_total"]
            if finished.get("abort") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert finished.get("abort") == 1 and not finished.get("length"), finished
        assert snapshot(http)["prefix_pins"] == 0
