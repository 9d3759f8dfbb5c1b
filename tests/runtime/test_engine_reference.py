"""The whole paged engine against transformers: greedy tokens on tiny random checkpoints.

The model tests check our decoder through the contiguous cache; this one checks the path the
agent really runs: checkpoint loader → engine → scheduler → paged pool → paged attention, with
pages small enough that every sequence spans several of them and a batch decoding together.
"""

import pytest
import torch
from hf_reference import FAMILY_VARIANTS, hf_greedy, reference_model
from kv_device import DEVICE

from kvctl.agent.kernels import cpu_ops
from kvctl.agent.model import SamplingParams, load_checkpoint
from kvctl.agent.model.fused import uses_kernels
from kvctl.agent.pool.defrag import DefragTrigger
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.settings import DefragSettings

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 10


@pytest.fixture(scope="module", params=FAMILY_VARIANTS)
def family(request, tmp_path_factory) -> tuple:
    """(transformers float32 model, its checkpoint directory) of each family."""
    reference = reference_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)
    return reference, path


def _engine(path, cpu_kernels: bool) -> Engine:
    _, model, tokenizer = load_checkpoint(path, DEVICE, torch.float32)
    assert tokenizer is None  # token ids in, token ids out
    return Engine(
        model,
        tokenizer,
        EngineConfig(
            page_size=4,
            pool_pages=64,
            segment_pages=16,
            defrag=DefragSettings(enabled=False),
            device=DEVICE,
            cpu_kernels=cpu_kernels,
        ),
    )


def _disturb(engine: Engine) -> None:
    """A full defragmentation and a resize (grow, then shrink back) between two steps."""
    engine.defragmenter.run(DefragTrigger.MANUAL)
    capacity = engine.pool.capacity
    engine.resizer.resize(capacity + 16)
    engine.resizer.resize(capacity)
    engine.pool.invariants.check()


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_engine_greedy_matches_transformers_generate(family, cpu_kernels) -> None:
    """Every family through the engine's paged pool: equal to transformers' greedy tokens, also
    with a defragmentation and resizes between every step, and again with the prompts' pages
    reused from the prefix cache."""
    reference, path = family
    engine = _engine(path, cpu_kernels)
    on_kernels = cpu_kernels and cpu_ops() is not None and DEVICE == "cpu"
    assert uses_kernels(engine.model) == on_kernels
    assert engine.cache.decode_read_path == ("paged" if on_kernels else "gather")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (9, 1, 23, 14)]
    expected = [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for disturbed in (False, True):  # the second pass also hits the prefix cache
        requests = [engine.add_request(p, params) for p in prompts]
        while engine.has_work():
            engine.step()
            if disturbed:
                _disturb(engine)
        assert [r.output_ids for r in requests] == expected
    assert engine.stats.prefix_hit_ratio, "the second pass must reuse cached pages"
    assert len({tuple(r) for r in expected}) > 1
