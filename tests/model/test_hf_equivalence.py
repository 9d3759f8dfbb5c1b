"""Our decoder against transformers' on tiny random checkpoints saved with `save_pretrained`.

Every parameter (biases and norm weights included) is re-drawn from a seeded generator with
scales that give peaked logits, so a wrong bias, rope frequency or head grouping moves the
argmax instead of hiding under near-uniform logits.
"""

from dataclasses import replace

import pytest
import torch
from hf_reference import PROMPT_LENS, VARIANTS, hf_greedy, reference_model
from kv_device import DEVICE

from kvctl.agent.kernels import cpu_ops
from kvctl.agent.model import ContiguousKVCache, load_checkpoint
from kvctl.agent.model.fused import fuse, uses_kernels

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory) -> tuple:
    """(reference transformers model, checkpoint dir, sharded checkpoint dir)."""
    reference = reference_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(root / "single")
    reference.save_pretrained(root / "sharded", max_shard_size="40KB")
    return reference, root / "single", root / "sharded"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def test_prefill_logits_match_transformers(checkpoint, prompts):
    reference, path, _ = checkpoint
    config, model, _ = load_checkpoint(path, DEVICE, torch.float32)
    cache = ContiguousKVCache(
        config, max_seqs=len(prompts), max_len=64, device=DEVICE, sinks=model.attention_sinks()
    )
    layout = cache.begin_step(list(range(len(prompts))), [len(p) for p in prompts])
    tokens = torch.tensor([t for p in prompts for t in p], device=DEVICE)
    ours = model.logits(model(tokens, layout.positions(DEVICE), cache)).cpu()  # [T, vocab]
    with torch.no_grad():
        expected = torch.cat([reference(torch.tensor([p])).logits[0] for p in prompts])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_matches_one_shot_prefill(checkpoint, prompts):
    """Prompts fed in two chunks (the second attends to the cached first) give the same logits."""
    reference, path, _ = checkpoint
    config, model, _ = load_checkpoint(path, DEVICE, torch.float32)
    long_prompts = [p for p in prompts if len(p) > 2]
    cache = ContiguousKVCache(
        config, len(long_prompts), max_len=64, device=DEVICE, sinks=model.attention_sinks()
    )
    seqs = list(range(len(long_prompts)))
    halves = [(p[: len(p) // 2], p[len(p) // 2 :]) for p in long_prompts]
    logits = []
    for part in (0, 1):
        chunks = [h[part] for h in halves]
        layout = cache.begin_step(seqs, [len(c) for c in chunks])
        tokens = torch.tensor([t for c in chunks for t in c], device=DEVICE)
        hidden = model(tokens, layout.positions(DEVICE), cache)
        logits.append(model.logits(hidden).cpu().split([len(c) for c in chunks]))
    with torch.no_grad():
        for i, p in enumerate(long_prompts):
            expected = reference(torch.tensor([p])).logits[0]
            torch.testing.assert_close(
                torch.cat([logits[0][i], logits[1][i]]), expected, atol=1e-4, rtol=1e-4
            )


def test_greedy_generation_matches_transformers(checkpoint, prompts, generate):
    reference, path, _ = checkpoint
    _, model, _ = load_checkpoint(path, DEVICE, torch.float32)
    ours = generate(model, prompts, 12)
    for prompt, tokens in zip(prompts, ours, strict=True):
        expected = hf_greedy(reference, prompt, 12)
        assert len(expected) == 12
        assert tokens == expected
    assert len({tuple(t) for t in ours}) > 1, "continuations should depend on the prompt"


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_the_serving_form_matches_transformers(checkpoint, prompts, generate, kernels):
    """`fuse` (fused products, the families' factors folded into weights, the CPU kernels or
    torch): the same prompt logits within 1e-4 and the same greedy tokens."""
    reference, path, _ = checkpoint
    config, model, _ = load_checkpoint(path, DEVICE, torch.float32)
    fuse(model, kernels=kernels)
    assert uses_kernels(model) == (kernels and DEVICE == "cpu" and cpu_ops() is not None)
    cache = ContiguousKVCache(
        config, max_seqs=len(prompts), max_len=64, device=DEVICE, sinks=model.attention_sinks()
    )
    layout = cache.begin_step(list(range(len(prompts))), [len(p) for p in prompts])
    tokens = torch.tensor([t for p in prompts for t in p], device=DEVICE)
    ours = model.logits(model(tokens, layout.positions(DEVICE), cache)).cpu()
    with torch.no_grad():
        expected = torch.cat([reference(torch.tensor([p])).logits[0] for p in prompts])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    continuations = generate(model, prompts, 12)
    assert continuations == [hf_greedy(reference, p, 12) for p in prompts]


def test_sharded_checkpoint_loads_identically(checkpoint):
    _, single, sharded = checkpoint
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    config_a, model_a, _ = load_checkpoint(single, "cpu")
    config_b, model_b, _ = load_checkpoint(sharded, "cpu")
    assert replace(config_b, name=config_a.name) == config_a
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name


def test_loaded_config_reads_the_checkpoint(checkpoint):
    reference, path, _ = checkpoint
    config, model, tokenizer = load_checkpoint(path, "cpu")
    hf = reference.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (
        hf.num_hidden_layers,
        4,
        2,
    )
    layer_types = getattr(hf, "layer_types", None) or []
    sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    assert config.sliding_layers == (sliding if config.sliding_window else ())
    assert config.sliding_window == (getattr(hf, "sliding_window", None) if sliding else None)
    assert config.head_dim == (getattr(hf, "head_dim", None) or 16) and config.vocab_size == 128
    assert config.eos_token_ids == (2,)
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert (model.lm_head is None) == hf.tie_word_embeddings
    assert config.attention_bias == (hf.model_type in ("qwen2", "gpt_oss"))
    assert config.model_type == hf.model_type
    assert tokenizer is None
    assert next(model.parameters()).dtype == torch.float32
