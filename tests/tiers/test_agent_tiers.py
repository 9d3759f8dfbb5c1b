"""A real `kvctl-agent` with a host tier and a disk tier, over real HTTP: a prompt evicted from
the device pool comes back from host memory, then from disk, with the same tokens, and the
readings of /v1/pool and /metrics say where its pages came from."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvctl.api import PoolMap, PoolSnapshot, TierReading

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PAGE = 16
PAGE_BYTES = 4 * 2 * PAGE * 4 * 32 * 4  # the demo model: layers, K/V, tokens, kv heads, dim, fp32
HOST_PAGES = 40
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
# 128 characters and the BOS token: 8 whole pages before the last token, which is computed
PROMPT = "".join(f"{i:03d} pages below the pool; " for i in range(6))[:128]
WHOLE_PAGES = 8


def others(round_: int) -> list[str]:
    """Four prompts of 13 pages each with no whole page in common with PROMPT or each other:
    together more than the pool, so everything cached before them leaves the device."""
    return [f"[{round_}.{n}] " + f"{chr(65 + n)}{round_}" * 100 for n in range(4)]


def complete(http: httpx.Client, prompt: str) -> list[int]:
    reply = http.post("/v1/completions", json={"prompt": prompt, **GREEDY})
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    return choice["token_ids"]


def pool(http: httpx.Client) -> PoolSnapshot:
    """A snapshot of this moment (/v1/pool may be up to 100 ms old; the map's is fresh)."""
    snapshot = PoolMap.model_validate(http.get("/v1/pool/map").json()).pool
    assert snapshot is not None
    return snapshot


def tier(snapshot: PoolSnapshot, name: str) -> TierReading:
    (reading,) = [t for t in snapshot.tiers if t.tier == name]
    return reading


def hits(snapshot: PoolSnapshot) -> dict[str, int]:
    return snapshot.prefix_hits_tokens_by_tier


def metric_hits(http: httpx.Client) -> dict[str, float]:
    """`kvctl_prefix_cache_hits_tokens_total` by its `tier` label."""
    return {
        sample.labels["tier"]: sample.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for sample in family.samples
        if sample.name == "kvctl_prefix_cache_hits_tokens_total"
    }


def wait_for(read: Callable[[], int], value: int, timeout: float = 10.0) -> int:
    """`read()` once it gives `value` (page files may be written in the background)."""
    deadline = time.monotonic() + timeout
    while (current := read()) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    return current


def test_a_prompt_comes_back_from_host_memory_then_from_disk(start_agent, tmp_path) -> None:
    disk = tmp_path / "pages"
    agent = start_agent(
        *("--pool-pages", "32", "--segment-pages", "8", "--page-size", str(PAGE)),
        *("--host-tier-memory", str(HOST_PAGES * PAGE_BYTES)),
        *("--disk-tier-path", str(disk), "--disk-tier-size", str(128 * (PAGE_BYTES + 48))),
    )
    with httpx.Client(base_url=agent.url, timeout=120) as http:
        start = pool(http)
        assert start.bytes_per_page == PAGE_BYTES
        assert tier(start, "host").capacity_pages == HOST_PAGES
        assert tier(start, "disk").capacity_pages == 128
        first = complete(http, PROMPT)
        for prompt in others(1):
            complete(http, prompt)
        evicted = pool(http)
        assert tier(evicted, "host").stored_pages_total >= WHOLE_PAGES
        assert tier(evicted, "host").evicted_pages_total == 0  # it all fits in host memory

        # from host memory: every whole page of the prompt, none from the device
        assert complete(http, PROMPT) == first
        from_host = pool(http)
        assert hits(from_host)["host"] - hits(evicted)["host"] == WHOLE_PAGES * PAGE
        assert hits(from_host)["device"] == hits(evicted)["device"]
        assert hits(from_host)["disk"] == hits(evicted)["disk"] == 0
        host_tier = tier(from_host, "host")
        assert host_tier.loaded_pages_total - tier(evicted, "host").loaded_pages_total == (
            WHOLE_PAGES
        )
        assert sum(hits(from_host).values()) == from_host.prefix_hits_tokens_total

        # off the device again, then the host tier turned off: its pages go down to disk
        for prompt in others(2):
            complete(http, prompt)
        held = tier(pool(http), "host").used_pages
        assert held >= WHOLE_PAGES
        reply = http.post("/v1/pool/resize", json={"tier": "host", "bytes": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["new_pages"] == 0 and reply.json()["pages_evicted"] == held
        demoted = pool(http)
        assert tier(demoted, "host").used_pages == 0
        assert tier(demoted, "disk").used_pages >= WHOLE_PAGES
        files = wait_for(lambda: len(list(disk.glob("*.kvpage"))), tier(demoted, "disk").used_pages)
        assert files == tier(demoted, "disk").used_pages

        # from disk: the same tokens, every whole page of the prompt counted to the disk tier
        assert complete(http, PROMPT) == first
        from_disk = pool(http)
        assert hits(from_disk)["disk"] - hits(demoted)["disk"] == WHOLE_PAGES * PAGE
        assert hits(from_disk)["host"] == hits(demoted)["host"]
        assert hits(from_disk)["device"] == hits(demoted)["device"]
        disk_tier = tier(from_disk, "disk")
        assert disk_tier.loaded_pages_total - tier(demoted, "disk").loaded_pages_total == (
            WHOLE_PAGES
        )
        assert disk_tier.hits_tokens_total == disk_tier.loaded_pages_total * PAGE
        assert not any(disk_tier.load_failures_total.values())
        assert sum(hits(from_disk).values()) == from_disk.prefix_hits_tokens_total

        # the same counts in the metrics (published from a snapshot at most 100 ms old)
        final = {name: float(n) for name, n in hits(pool(http)).items()}
        deadline = time.monotonic() + 10
        while (by_tier := metric_hits(http)) != final and time.monotonic() < deadline:
            time.sleep(0.05)
        assert by_tier == final
        assert by_tier["host"] == by_tier["disk"] == WHOLE_PAGES * PAGE
