"""Rotary embeddings against transformers' reference formulas."""

import pytest
import torch

from kvctl.agent.model import ModelConfig, RotaryEmbedding, apply_rotary, inv_frequencies
from kvctl.agent.model.rope import attention_scaling, dynamic_inv_frequencies

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {  # DeepSeek's form: the attention factor from mscale and mscale_all_dim
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "longrope": {  # Phi-3's form: the factor from the contexts, per-dimension short/long factors
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(32)],
        "long_factor": [1.0 + 0.5 * i for i in range(32)],
        "original_max_position_embeddings": 64,
    },
}


def _configs(scaling: dict | None) -> tuple:
    hf = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=50000.0,
        rope_scaling=dict(scaling) if scaling else None,
    )
    return hf, ModelConfig.from_hf(hf.to_dict(), "rope")


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_inv_frequencies_match_transformers(kind):
    hf, ours = _configs(SCALINGS[kind])
    scale = 1.0
    if kind == "default":
        expected = modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(hf)[0]
    else:
        expected, scale = rope_utils.ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
    assert ours.head_dim == 64
    torch.testing.assert_close(inv_frequencies(ours), expected, rtol=0, atol=0)
    assert attention_scaling(ours) == pytest.approx(scale, rel=1e-12)


@pytest.mark.parametrize("position", [0, 255, 256, 300, 1000])
def test_dynamic_frequencies_follow_each_tokens_length(position):
    hf, ours = _configs(SCALINGS["dynamic"])
    expected, _ = rope_utils.ROPE_INIT_FUNCTIONS["dynamic"](
        hf, "cpu", seq_len=torch.tensor(position + 1)
    )
    got = dynamic_inv_frequencies(ours, torch.tensor([position]))[0]
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_longrope_takes_the_long_factors_from_the_original_context_on():
    """Each token by its own length: a token at position 63 (length 64, the original context)
    rotates with the short factors, one at 64 with the long ones, whatever else the batch
    holds; transformers' generate does the same for every token decoded one at a time."""
    hf, ours = _configs(SCALINGS["longrope"])
    short, scale = rope_utils.ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=64)
    long, _ = rope_utils.ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=65)
    positions = torch.tensor([63, 64, 0, 200])
    cos, _ = RotaryEmbedding(ours)(positions, torch.float32)
    for i, table in enumerate((short, long, short, long)):
        angles = positions[i] * table
        torch.testing.assert_close(cos[i], torch.cat((angles, angles)).cos() * scale)


@pytest.mark.parametrize("kind", ["default", "llama3", "yarn", "longrope"])
def test_rotation_at_explicit_positions_matches_transformers(kind):
    hf, ours = _configs(SCALINGS[kind])
    positions = torch.tensor([7, 0, 3, 50, 1, 1])  # a paged batch: any order, repeats allowed
    if kind != "longrope":  # longrope's table depends on the longest position (the test above)
        positions[3] = 200
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 64, generator=gen)  # [T, h, d]
    k = torch.randn(6, 2, 64, generator=gen)  # [T, kvh, d]
    cos, sin = RotaryEmbedding(ours)(positions, torch.float32)
    ref_cos, ref_sin = modeling_llama.LlamaRotaryEmbedding(hf)(q, positions[None])
    ref_q, ref_k = modeling_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin
    )  # [1, heads, T, d]
    torch.testing.assert_close(cos, ref_cos[0])
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1))
