"""The built-in demo model and its byte tokenizer."""

import hashlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvctl.agent.model import ByteTokenizer, build_demo_model


def _weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_same_seed_same_weights_whatever_the_global_rng():
    torch.manual_seed(1)
    _, first, _ = build_demo_model("cpu", seed=0)
    torch.manual_seed(2)
    torch.rand(100)
    _, second, _ = build_demo_model("cpu", seed=0)
    _, other, _ = build_demo_model("cpu", seed=1)
    assert _weights_digest(first) == _weights_digest(second)
    assert _weights_digest(first) != _weights_digest(other)


def test_demo_shape_and_tokenizer_agree(demo):
    config, model, tokenizer = demo
    assert config.vocab_size == tokenizer.vocab_size == 258
    assert config.eos_token_ids == tokenizer.eos_token_ids == (257,)
    assert config.bos_token_id == 256
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        4,
        8,
        4,
        32,
    )
    assert 3_000_000 < sum(p.numel() for p in model.parameters()) < 3_500_000


@pytest.mark.slow
def test_greedy_continuations_depend_on_the_prompt(demo, generate):
    _, model, tokenizer = demo
    texts = ["Hello world", "The quick brown fox", "kvctl pages", "1234"]
    outputs = generate(model, [tokenizer.encode(t) for t in texts], 24)
    assert len({tuple(o) for o in outputs}) == len(texts)
    assert all(len(set(o)) >= 4 for o in outputs), "greedy output should not be one repeated token"
    printable = sum(32 <= t < 127 for o in outputs for t in o)
    assert printable / sum(len(o) for o in outputs) > 0.9


@given(st.text())
def test_byte_tokenizer_round_trips_text(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.BOS
    assert all(0 <= i < 256 for i in ids[1:])
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([*ids, tokenizer.EOS]) == text


def test_byte_tokenizer_decodes_partial_characters():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("né")  # BOS, 'n', 0xC3, 0xA9
    assert tokenizer.decode(ids[:3]) == "n\ufffd"
    assert tokenizer.decode(ids) == "né"
