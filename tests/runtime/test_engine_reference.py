"""The whole paged engine against transformers: greedy tokens on tiny random checkpoints.

The model tests check our decoder through the contiguous cache; this one checks the path the
agent really runs: checkpoint loader → engine → scheduler → paged pool → paged attention, with
pages small enough that every sequence spans several of them and a batch decoding together.
"""

import pytest
import torch
from hf_reference import SHAPE, hf_greedy, peaked_weights
from kv_device import DEVICE

from kvctl.agent.kernels import cpu_ops
from kvctl.agent.model import SamplingParams, load_checkpoint
from kvctl.agent.model.fused import uses_kernels
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.settings import DefragSettings

transformers = pytest.importorskip("transformers")

VARIANTS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
NEW_TOKENS = 10


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_engine_greedy_matches_transformers_generate(variant, cpu_kernels, tmp_path) -> None:
    architecture = VARIANTS[variant]
    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    reference = getattr(transformers, architecture)(config_cls(**SHAPE)).eval()
    peaked_weights(reference, seed=3)
    reference.save_pretrained(tmp_path)
    _, model, tokenizer = load_checkpoint(tmp_path, DEVICE, torch.float32)
    assert tokenizer is None  # token ids in, token ids out
    engine = Engine(
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
    on_kernels = cpu_kernels and cpu_ops() is not None and DEVICE == "cpu"
    assert uses_kernels(engine.model) == on_kernels
    assert engine.cache.decode_read_path == ("paged" if on_kernels else "gather")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (9, 1, 23, 14)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    for prompt, request in zip(prompts, requests, strict=True):
        assert request.output_ids == hf_greedy(reference, prompt, NEW_TOKENS)
    assert len({tuple(r.output_ids) for r in requests}) > 1
