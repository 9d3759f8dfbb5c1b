"""The start-up plan of the pools (kvctl.agent.startup.planning), from plain inputs and without
torch: one model, several under a KV budget, their tiers, and the refusals."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvctl.agent.config import AgentConfig, ConfigError, ModelSpec
from kvctl.agent.startup.planning import (
    ModelPages,
    PoolPlan,
    TierShare,
    check_names,
    demo_shape,
    plan_pools,
)
from kvctl.settings import StartupLimits

PAGE = 64 << 10  # bytes of one page of a small model


def model(name: str = "demo", per_page: int = PAGE, **limits: Any) -> ModelPages:
    return ModelPages(name, ModelSpec(name=name, **limits), per_page)


def config(**values: Any) -> AgentConfig:
    return AgentConfig(**values)


def test_the_planning_module_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvctl.agent.startup.planning, kvctl.agent.startup.settings\n"
        "import kvctl.agent.startup.main\n"
        "assert sys.modules['torch'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_one_model_takes_the_default_size_with_room_to_grow() -> None:
    plan = plan_pools(config(), [model()], None)
    assert plan.budget_bytes is None
    [pool] = plan.pools
    assert (pool.pages, pool.segment, pool.floor, pool.ceiling) == (1024, 128, 128, 4096)
    assert pool.limits == StartupLimits(128, 4096)
    assert pool.tiers == TierShare(0, None, 0)


def test_one_model_is_sized_by_pages_memory_or_budget() -> None:
    assert plan_pools(config(pool_pages=100), [model()], None).pools[0].pages == 100
    assert plan_pools(config(pool_pages=100), [model()], None).pools[0].capacity == 104
    by_memory = plan_pools(config(pool_memory="8MiB"), [model()], None).pools[0]
    assert by_memory.pages == (8 << 20) // PAGE == 128
    by_budget = plan_pools(config(kv_budget="8MiB"), [model()], None)
    [pool] = by_budget.pools
    assert by_budget.budget_bytes is None  # one model: the budget is its ceiling
    assert (pool.pages, pool.ceiling) == (128, 128)
    sized = plan_pools(config(pool_pages=64, kv_budget="8MiB"), [model()], None).pools[0]
    assert (sized.pages, sized.ceiling) == (64, 128)


def test_a_share_of_free_gpu_memory() -> None:
    cuda = config(device="cuda", gpu_memory_fraction=0.5)
    assert plan_pools(cuda, [model()], 16 << 20).pools[0].pages == 128
    with pytest.raises(ConfigError, match="no GPU memory reading"):
        plan_pools(cuda, [model()], None)


def test_a_lone_pool_above_its_ceiling_is_refused() -> None:
    with pytest.raises(ConfigError, match="above --max-pool-pages 64"):
        plan_pools(config(), [model(max_pool_pages=64)], None)


def test_two_models_share_the_budget_equally_by_bytes() -> None:
    big, small = model("big", 4 * PAGE), model("small", PAGE)
    plan = plan_pools(config(kv_budget="16MiB"), [big, small], None)
    assert plan.budget_bytes == 16 << 20
    first, second = plan.pools
    # 8 MiB each: 32 pages of the big model, 128 of the small one, an eighth per segment
    assert (first.pages, first.segment, first.floor) == (32, 4, 4)
    assert (second.pages, second.segment, second.floor) == (128, 16, 16)
    # each may grow while the other is at its floor
    assert first.ceiling == ((16 << 20) - 16 * PAGE) // (4 * PAGE) // 4 * 4
    assert second.ceiling == ((16 << 20) - 4 * 4 * PAGE) // PAGE // 16 * 16
    total = first.pages * 4 * PAGE + second.pages * PAGE
    assert total <= plan.budget_bytes


def test_without_a_budget_several_pools_share_the_sum_of_their_sizes() -> None:
    plan = plan_pools(config(pool_pages=64), [model("a"), model("b")], None)
    assert plan.budget_bytes == 2 * 64 * PAGE
    assert [p.pages for p in plan.pools] == [64, 64]


def test_sizes_over_the_budget_are_refused() -> None:
    with pytest.raises(ConfigError, match="over the KV budget"):
        plan_pools(
            config(kv_budget="1MiB"), [model("a", pool_pages=64), model("b", pool_pages=64)], None
        )
    with pytest.raises(ConfigError, match="less than one page of a"):
        plan_pools(config(kv_budget="64KiB"), [model("a"), model("b")], None)


def test_a_pool_outside_its_floor_and_ceiling_is_refused() -> None:
    with pytest.raises(ConfigError, match="model a: its pool of 64 pages is outside"):
        plan_pools(
            config(kv_budget="16MiB"),
            [model("a", pool_pages=64, max_pool_pages=32), model("b")],
            None,
        )


def test_several_models_split_the_tiers_and_get_a_directory_each(tmp_path: Any) -> None:
    tiered = config(
        model=["a=demo", "b=demo"], host_tier_memory="8MiB", disk_tier_path=str(tmp_path)
    )
    plan = plan_pools(tiered, [model("a"), model("b")], None)
    assert [p.tiers for p in plan.pools] == [
        TierShare(4 << 20, str(tmp_path / "a"), 5 << 30),
        TierShare(4 << 20, str(tmp_path / "b"), 5 << 30),
    ]
    lone = plan_pools(config(host_tier_memory="8MiB"), [model()], None).pools[0]
    assert lone.tiers == TierShare(8 << 20, None, 0)


def test_names_must_differ_and_not_share_a_tier_directory(tmp_path: Any) -> None:
    check_names(config(), ["a", "b"])
    with pytest.raises(ConfigError, match="two models are named the same"):
        check_names(config(), ["a", "a"])
    with pytest.raises(ConfigError, match="would share a directory"):
        check_names(config(disk_tier_path=str(tmp_path)), ["a b", "a_b"])
    check_names(config(), ["a b", "a_b"])  # no disk tier: no directories


def test_demo_shapes() -> None:
    assert demo_shape("demo") == (4, 4) and demo_shape("demo:8x2") == (8, 2)
    assert demo_shape("/models/llama") is None
    with pytest.raises(ConfigError, match="write demo:LAYERSxKV_HEADS"):
        demo_shape("demo:8")
    with pytest.raises(ConfigError, match="1 to 64 layers"):
        demo_shape("demo:8x3")


def test_the_capacity_is_whole_segments() -> None:
    assert PoolPlan(100, 8, 8, 400, TierShare(0, None, 0)).capacity == 104
