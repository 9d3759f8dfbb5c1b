"""Workload generators: seeded, shaped as the three allocation scenarios say, budgets that
pressure memory."""

from collections import Counter

import pytest

from kvctl.simulate.workloads import (
    GEMMA_2B,
    LLAMA_70B,
    MISTRAL_7B,
    Request,
    build_workload,
    lifetime_steps,
    peak_demand_bytes,
)


@pytest.mark.parametrize("name", ["high-concurrency", "random-lengths", "multi-model"])
def test_same_seed_same_workload_other_seed_other_workload(name: str) -> None:
    assert build_workload(name, 7) == build_workload(name, 7)
    assert build_workload(name, 7).requests != build_workload(name, 8).requests


@pytest.mark.parametrize("name", ["high-concurrency", "random-lengths", "multi-model"])
def test_every_request_is_well_formed(name: str) -> None:
    workload = build_workload(name, 0)
    arrivals = [r.arrival for r in workload.requests]
    assert arrivals == sorted(arrivals)
    assert [r.id for r in workload.requests] == list(range(len(workload.requests)))
    for r in workload.requests:
        assert 1 <= r.output_tokens <= r.max_output_tokens
        assert r.prompt_tokens >= 1
    outputs = [r.output_tokens for r in workload.requests]
    caps = [r.max_output_tokens for r in workload.requests]
    assert sum(outputs) < 0.6 * sum(caps), "real generations should stop well before the cap"


def test_high_concurrency_is_a_burst_of_8k_context_requests() -> None:
    workload = build_workload("high-concurrency", 0)
    assert len(workload.requests) == 1000
    assert {r.arrival for r in workload.requests} == {0}
    assert all(1024 <= r.prompt_tokens <= 6144 for r in workload.requests)
    assert all(r.reserved_tokens <= 8192 for r in workload.requests)
    assert workload.models == (LLAMA_70B,)


def test_random_lengths_span_1k_to_16k() -> None:
    workload = build_workload("random-lengths", 0)
    lengths = [r.reserved_tokens for r in workload.requests]
    assert len(lengths) == 500
    assert 1024 <= min(lengths) < 2048
    assert 15360 < max(lengths) <= 16384


def test_multi_model_shares_one_budget_among_three_kv_sizes_with_shifting_popularity() -> None:
    workload = build_workload("multi-model", 0)
    assert workload.models == (LLAMA_70B, MISTRAL_7B, GEMMA_2B)
    assert len({m.kv_bytes_per_token for m in workload.models}) == 3
    third = len(workload.requests) // 3
    for phase, model in enumerate(workload.models):
        requests = workload.requests[phase * third : (phase + 1) * third]
        top, _ = Counter(r.model for r in requests).most_common(1)[0]
        assert top == model.name


@pytest.mark.parametrize("name", ["high-concurrency", "random-lengths", "multi-model"])
def test_budget_pressures_memory_but_fits_the_largest_request(name: str) -> None:
    workload = build_workload(name, 0)
    per_token = {m.name: m.kv_bytes_per_token for m in workload.models}
    largest = max(r.reserved_tokens * per_token[r.model] for r in workload.requests)
    assert largest < workload.budget_bytes < 0.5 * workload.peak_demand_bytes


def test_peak_demand_counts_overlapping_reservations() -> None:
    # decode chunk 16: a 32-token output lives 1 prefill + 2 decode steps
    requests = [
        Request(0, 0, 10, 40, 32, LLAMA_70B.name),  # steps 0..2, 50 tokens reserved
        Request(1, 2, 20, 10, 16, LLAMA_70B.name),  # steps 2..3, 30 tokens
        Request(2, 3, 5, 5, 1, LLAMA_70B.name),  # steps 3..4, 10 tokens: A has ended
    ]
    assert lifetime_steps(requests[0], 16) == 3
    per_token = LLAMA_70B.kv_bytes_per_token
    assert peak_demand_bytes(requests, [LLAMA_70B], 16) == 80 * per_token


def test_overrides_and_bad_input() -> None:
    small = build_workload("random-lengths", 0, requests=40, budget_fraction=0.5)
    assert len(small.requests) == 40
    assert small.budget_fraction == 0.5
    with pytest.raises(ValueError, match="unknown scenario"):
        build_workload("no-such-scenario", 0)
    with pytest.raises(ValueError, match="budget_fraction"):
        build_workload("random-lengths", 0, budget_fraction=1.5)
    with pytest.raises(ValueError, match="requests"):
        build_workload("random-lengths", 0, requests=0)
