"""Several models on one real agent: routing by `model`, one pool per model under one budget,
the single-pool routes, and tokens that do not change while another model's pool is resized or
gives memory to a pool under pressure."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from agent_process import launch_agent, refused_at_start
from prometheus_client.parser import text_string_to_metric_families

from kvctl.agent.config import ConfigError, load_config
from kvctl.api import PoolList

MODELS = ("--model", "small=demo", "--model", "big=demo:8x4")
TIERS = ("host", "disk")
PAGE_TOKENS = 16


def below_device(snapshot) -> int:
    """Prompt tokens the pool's tiers below the device served."""
    by_tier = snapshot.prefix_hits_tokens_by_tier
    return by_tier.get("host", 0) + by_tier.get("disk", 0)


SMALL_BUDGET = ("--pool-pages", "64", "--segment-pages", "16", "--page-size", "16")
GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
FAST_REBALANCE = (
    "--set",
    "rebalance.pressure_s=0.3",
    "--set",
    "rebalance.calm_s=0.5",
    "--set",
    "rebalance.cooldown_s=60",
)


def tokens(http: httpx.Client, model: str, prompt: str, max_tokens: int, **extra) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **GREEDY, **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def wait_for(condition, timeout: float = 10.0):
    """The condition's first true value (snapshots are published every 100 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"not true within {timeout} s")


def samples(text: str) -> dict[tuple[str, str, str], float]:
    """(name, pool, direction or trigger) -> value of every kvctl sample."""
    return {
        (
            sample.name,
            sample.labels["pool"],
            sample.labels.get("direction", "") or sample.labels.get("trigger", ""),
        ): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("kvctl_") and "pool" in sample.labels
    }


def pools(http: httpx.Client) -> PoolList:
    return PoolList.model_validate(http.get("/v1/pools").json())


def within_budget(listing: PoolList) -> bool:
    assert listing.budget_bytes is not None
    return sum(p.capacity_bytes for p in listing.pools) <= listing.budget_bytes


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """One agent serving `small` (the demo model) and `big` (8 layers: pages twice as large)."""
    agent = launch_agent(*MODELS, *SMALL_BUDGET, tmp=tmp_path_factory.mktemp("agent"))
    yield agent
    agent.stop()


def test_each_model_is_listed_routed_and_has_its_own_pool(two_models) -> None:
    with httpx.Client(base_url=two_models.url, timeout=60) as http:
        ids = [card["id"] for card in http.get("/v1/models").json()["data"]]
        assert ids == ["small", "big"]
        for model in ("small", "big"):
            body = {"model": model, "prompt": "route me", "max_tokens": 4, **GREEDY}
            answer = http.post("/v1/completions", json=body).json()
            assert answer["model"] == model
        listing = wait_for(
            lambda: (
                (got := pools(http))
                and all(p.generation_tokens_total >= 4 for p in got.pools)
                and got
            )
        )
        assert [p.pool for p in listing.pools] == ["small", "big"]
        small, big = listing.pools
        assert big.bytes_per_page == 2 * small.bytes_per_page
        assert listing.budget_bytes == 64 * small.bytes_per_page + 64 * big.bytes_per_page
        assert within_budget(listing)
        for snapshot in listing.pools:
            assert snapshot.share is not None and snapshot.share.pools_total == 2
        metrics = http.get("/metrics").text
        assert 'kvctl_pool_capacity_pages{pool="small"} 64.0' in metrics
        assert 'kvctl_pool_capacity_pages{pool="big"} 64.0' in metrics


def test_the_small_model_gives_the_same_tokens_as_the_demo_agent_alone(
    two_models, start_agent
) -> None:
    alone = start_agent(*SMALL_BUDGET)
    prompt = "the same weights answer the same"
    with httpx.Client(base_url=two_models.url, timeout=60) as http:
        shared = tokens(http, "small", prompt, 24)
        other = tokens(http, "big", prompt, 24)
    with httpx.Client(base_url=alone.url, timeout=60) as http:
        assert tokens(http, "demo", prompt, 24) == shared
    assert other != shared  # another shape, other weights


def test_unknown_and_missing_models_and_single_pool_routes(two_models) -> None:
    with httpx.Client(base_url=two_models.url, timeout=30) as http:
        unknown = http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "model_not_found"
        assert "'small', 'big'" in unknown.json()["error"]["message"]
        missing = http.post("/v1/completions", json={"prompt": "x"})
        assert missing.status_code == 400 and "give `model`" in missing.json()["error"]["message"]
        tokenized = http.post("/v1/tokenize", json={"model": "big", "prompt": "abc"})
        assert tokenized.json()["model"] == "big"
        for method, path in (
            ("GET", "/v1/pool"),
            ("GET", "/v1/pool/map"),
            ("POST", "/v1/defrag"),
        ):
            answer = http.request(method, path)
            assert answer.status_code == 409, (path, answer.text)
            assert answer.json()["error"]["type"] == "pool_required"
            assert "/v1/pools/NAME" in answer.json()["error"]["message"]
        resize = http.post("/v1/pool/resize", json={"pages": 64})
        assert resize.status_code == 409
        nope = http.get("/v1/pools/nope")
        assert nope.status_code == 404 and nope.json()["error"]["type"] == "unknown_pool"
        named = http.get("/v1/pools/big/map").json()
        assert named["pool"]["pool"] == "big" and named["capacity_pages"] == 64


def test_a_resize_pins_within_the_budget_and_release_unpins(start_agent) -> None:
    agent = start_agent(*MODELS, *SMALL_BUDGET)
    with httpx.Client(base_url=agent.url, timeout=30) as http:
        over = http.post("/v1/pools/big/resize", json={"pages": 80})
        assert over.status_code == 409 and "--kv-budget" in over.json()["error"]["message"]
        assert [p.capacity_pages for p in pools(http).pools] == [64, 64]  # nothing changed
        shrunk = http.post("/v1/pools/small/resize", json={"pages": 32}).json()
        assert shrunk["new_pages"] == 32 and shrunk["pinned"] is True
        grown = http.post("/v1/pools/big/resize", json={"pages": 80}).json()
        assert grown["new_pages"] == 80
        listing = pools(http)
        assert within_budget(listing) and listing.assigned_bytes == listing.budget_bytes
        assert [p.share.pinned for p in listing.pools] == [True, True]
        released = http.post("/v1/pools/small/release").json()
        assert released == {"pool": "small", "was_pinned": True}
        wait_for(lambda: [p.share.pinned for p in pools(http).pools] == [False, True])
        metrics = http.get("/metrics").text
        assert 'kvctl_pool_pinned{pool="big"} 1.0' in metrics


async def _stream_tokens(url: str, body: dict) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["token_ids"]


async def _flood(url: str, model: str, count: int, prompt: str, max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **GREEDY}
    async with httpx.AsyncClient(base_url=url, timeout=180) as http:
        answers = await asyncio.gather(
            *(http.post("/v1/completions", json=body) for _ in range(count))
        )
    return [a.status_code for a in answers]


async def _watch(url: str, running: asyncio.Task, seen: list[PoolList]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while not running.done():
            seen.append(PoolList.model_validate((await http.get("/v1/pools")).json()))
            await asyncio.sleep(0.05)


LEND_ALL_BUT_USED = (
    "--set",
    "rebalance.headroom_ratio=0",
    "--set",
    "rebalance.peak_window_s=0",
)
# Long enough to outlast the flood's first move (pressure_s plus a check) on a fast CPU.
LONG_ANSWER = 1000  # max_tokens_limit is 1024
UNEVEN_POOLS = """
[[models]]
name = "small"
path = "demo"
pool_pages = 128
[[models]]
name = "big"
path = "demo:8x4"
pool_pages = 64
"""


@pytest.mark.slow
def test_a_pool_under_pressure_takes_memory_from_a_calm_one_without_changing_its_tokens(
    start_agent, tmp_path
) -> None:
    """`big` is flooded with more than its pool holds while `small` generates one long answer:
    the rebalancer shrinks `small` (evacuating its live pages) and grows `big`; the long answer
    is the same as the one computed alone. (`small` lends all but what it uses and has promised,
    so that its shrink surely reaches the pages of the running answer.)"""
    config = tmp_path / "agent.toml"
    config.write_text(UNEVEN_POOLS)
    agent = start_agent(
        "--config", str(config), "--segment-pages", "16", *FAST_REBALANCE, *LEND_ALL_BUT_USED
    )
    filler = "f" * 470  # cached at the lowest page ids, so the long answer lives higher up
    prompt = "a long answer that must not change while its pool shrinks"
    long_body = {"model": "small", "prompt": prompt, "max_tokens": LONG_ANSWER, **GREEDY}
    with httpx.Client(base_url=agent.url, timeout=120) as http:
        reference = tokens(http, "small", prompt, LONG_ANSWER, cache_salt="reference")
        tokens(http, "small", filler, 1)

    async def scenario() -> tuple[list[int], list[int], list[PoolList]]:
        seen: list[PoolList] = []
        answer = asyncio.ensure_future(_stream_tokens(agent.url, long_body))
        await asyncio.sleep(0.2)
        flood = asyncio.ensure_future(_flood(agent.url, "big", 6, "b" * 400, 300))
        await _watch(agent.url, answer, seen)
        return await answer, await flood, seen

    got, statuses, seen = asyncio.run(scenario())
    assert got == reference
    assert statuses == [200] * 6
    assert seen and all(within_budget(listing) for listing in seen)
    moved = [s for s in seen if s.pools[0].share.rebalances_total.get("out", 0) >= 1]
    assert moved, "small gave no memory while its long answer ran"
    small, big = moved[0].pools
    assert small.capacity_pages < 128 and big.capacity_pages > 64
    assert big.share.rebalances_total["in"] >= 1
    with httpx.Client(base_url=agent.url, timeout=30) as http:
        metrics = samples(http.get("/metrics").text)
    assert metrics[("kvctl_pool_rebalances_total", "small", "out")] >= 1
    assert metrics[("kvctl_pool_rebalanced_bytes_total", "big", "in")] >= 16 * big.bytes_per_page
    assert metrics[("kvctl_defrag_runs_total", "small", "shrink")] >= 1
    assert metrics[("kvctl_defrag_pages_moved_total", "small", "")] >= 1  # live pages moved


@pytest.mark.slow
def test_tokens_on_one_model_do_not_change_while_the_other_pool_is_resized(start_agent) -> None:
    agent = start_agent(*MODELS, *SMALL_BUDGET)
    prompt = "steady tokens while the neighbour resizes"
    body = {"model": "small", "prompt": prompt, "max_tokens": 240, **GREEDY}
    with httpx.Client(base_url=agent.url, timeout=120) as http:
        reference = tokens(http, "small", prompt, 240, cache_salt="alone")

    async def scenario() -> list[int]:
        answer = asyncio.ensure_future(_stream_tokens(agent.url, body))
        async with httpx.AsyncClient(base_url=agent.url, timeout=30) as http:
            for pages in (32, 48, 16, 64):
                resized = await http.post("/v1/pools/big/resize", json={"pages": pages})
                assert resized.status_code == 200, resized.text
                await asyncio.sleep(0.05)
        return await answer

    assert asyncio.run(scenario()) == reference


# ---- configuration ------------------------------------------------------------------------


def test_models_come_from_flags_or_toml_tables(tmp_path) -> None:
    config = load_config({"model": ["a=demo", "b=demo:8x2"]})
    assert [(s.name, s.path) for s in config.model_specs()] == [("a", "demo"), ("b", "demo:8x2")]
    toml = tmp_path / "agent.toml"
    toml.write_text(
        'kv_budget = "64MiB"\n'
        '[[models]]\nname = "chat"\npath = "demo"\nserved_model_name = ["assistant"]\n'
        "min_pool_pages = 32\n"
        '[[models]]\nname = "code"\npath = "demo:8x4"\npool_pages = 128\n'
    )
    config = load_config({}, toml)
    chat, code = config.model_specs()
    assert (chat.name, chat.served_model_name, chat.min_pool_pages) == ("chat", ["assistant"], 32)
    assert (code.path, code.pool_pages) == ("demo:8x4", 128)
    assert config.kv_budget == 64 << 20


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"model": ["a=demo", "b=demo"], "served_model_name": ["x"]}, "name each one"),
        ({"model": ["a=demo", "a=demo:8x4"]}, "two models have the same name"),
        ({"model": ["=demo"]}, "write NAME=PATH"),
        ({"model": ["a=demo", "b=demo"], "kv_budget": "0"}, "more than 0 bytes"),
    ],
)
def test_bad_model_configurations_are_one_line_errors(flags, message) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(flags)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "demo", "--model", "demo"], "two models are named the same"),
        ([*MODELS, "--kv-budget", "100KiB"], "less than one page"),
        ([*MODELS, "--pool-pages", "64", "--kv-budget", "8MiB"], "over the KV budget"),
        (["--model", "a=demo:3x3", "--model", "b=demo"], "1, 2, 4 or 8 KV heads"),
    ],
)
def test_models_that_cannot_share_are_refused_at_start(flags, message) -> None:
    assert message in refused_at_start(*flags)


@pytest.mark.slow
def test_a_request_larger_than_its_shrunk_pool_waits_for_memory_instead_of_a_400(
    start_agent,
) -> None:
    """A pool shrunk to 16 pages, released, then sent a request of 40 pages: the budget could
    give it that much, so it is admitted, waits, and the agent moves the memory."""
    agent = start_agent(*MODELS, *SMALL_BUDGET, *FAST_REBALANCE)
    with httpx.Client(base_url=agent.url, timeout=120) as http:
        assert http.post("/v1/pools/big/resize", json={"pages": 16}).status_code == 200
        assert http.post("/v1/pools/big/release").status_code == 200
        body = {"model": "big", "prompt": "p" * 400, "max_tokens": 230, **GREEDY}
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"][0]["token_ids"]) == 230
        big = http.get("/v1/pools/big").json()
        assert big["capacity_pages"] >= 40 and big["share"]["rebalances_total"]["in"] >= 1
        too_big = {"model": "big", "prompt": "p" * 3000, "max_tokens": 1000, **GREEDY}
        refused = http.post("/v1/completions", json=too_big)
        assert refused.status_code == 400  # 250 pages: more than the whole budget could give
        assert "within the KV budget" in refused.json()["error"]["message"]
        assert "--kv-budget" in refused.json()["error"]["message"]
        assert within_budget(pools(http))


@pytest.mark.slow
def test_each_model_has_its_share_of_the_tiers_and_a_directory_of_its_own(
    start_agent, tmp_path
) -> None:
    """Host memory and disk split equally, a directory per model; a prompt evicted from `big`'s
    pool comes back from its own tiers with the same tokens, and `small`'s tiers see none of
    it."""
    disk = tmp_path / "pages"
    agent = start_agent(
        *MODELS,
        *("--pool-pages", "32", "--segment-pages", "8"),
        *("--host-tier-memory", "8MiB", "--disk-tier-path", str(disk), "--disk-tier-size", "16MiB"),
    )
    prompt = "".join(f"{i:03d} a prompt for the big model's host tier; " for i in range(4))
    with httpx.Client(base_url=agent.url, timeout=120) as http:
        small, big = pools(http).pools
        for snapshot in (small, big):
            host, disk_tier = (next(t for t in snapshot.tiers if t.tier == n) for n in TIERS)
            assert host.capacity_pages * host.page_bytes <= 4 << 20
            assert host.capacity_pages == (4 << 20) // host.page_bytes
            assert disk_tier.path == str(disk / snapshot.pool)
        first = tokens(http, "big", prompt, 8)
        for n in range(4):  # more than big's 32 pages: the prompt's pages leave the device
            tokens(http, "big", f"[{n}] " + "x" * 200, 4)
        assert tokens(http, "big", prompt, 8) == first
        below = wait_for(lambda: below_device(pools(http).pools[1]))
        assert below >= 10 * PAGE_TOKENS  # its whole pages, from host memory or from disk
        small_after = pools(http).pools[0]
        assert all(t.stored_pages_total == 0 for t in small_after.tiers)
    assert sorted(p.name for p in disk.iterdir()) == ["big", "small"]


def test_a_models_tier_directory_stays_inside_the_disk_path() -> None:
    from kvctl.agent.startup.planning import tier_directory

    assert tier_directory("big") == "big"
    assert tier_directory("llama 3:8b") == "llama_3_8b"
    assert tier_directory("..") == "_.." and tier_directory(".hidden") == "_.hidden"
