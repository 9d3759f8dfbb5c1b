"""Rotary position embeddings, computed from each token's own position.

In a flattened paged batch every token carries its own position, so the rotation is a function of
a `positions` tensor [T] rather than of an offset and a length. The inverse frequencies follow
transformers' `ROPE_INIT_FUNCTIONS` formula for formula (same float32 operations in the same
order), so logits match the reference to float rounding.
"""

import math

import torch
from torch import Tensor

from kvctl.agent.model.config import ModelConfig


def inv_frequencies(config: ModelConfig, local: bool = False) -> Tensor:
    """Inverse frequencies [head_dim // 2] (float32, CPU) for positions inside the trained context;
    `local`: the sliding layers' own plain RoPE (`local_rope_theta`, Gemma 3).

    `dynamic` scaling only changes frequencies past `max_position_embeddings`; see
    `dynamic_inv_frequencies` for those.
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # [d/2]
    if local:
        assert config.local_rope_theta is not None
        return 1.0 / (config.local_rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {"rope_type": "default"}
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama 3.1 smoothing: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def dynamic_inv_frequencies(config: ModelConfig, positions: Tensor) -> Tensor:
    """Per-token inverse frequencies [T, head_dim // 2] for dynamic-NTK scaling.

    transformers rescales the base from the largest position in its forward call, which makes a
    token's rotation depend on what else is in the batch. Here each token uses its own length
    (position + 1): identical to transformers whenever the context is within
    `max_position_embeddings` and for one-token decode steps, and independent of batch composition.
    """
    assert config.rope_scaling is not None
    dim = config.head_dim
    max_pos = config.max_position_embeddings
    factor = config.rope_scaling["factor"]
    seq_len = torch.clamp(positions + 1, min=max_pos)  # [T]
    base = config.rope_theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
    return 1.0 / (base[:, None] ** exponents[None, :])  # [T, d/2]


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for a batch of positions; holds no parameters and no state dict entries.
    `local`: the sliding layers' own rope (`ModelConfig.local_rope`)."""

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        super().__init__()
        self.config = config
        self.dynamic = not local and (config.rope_scaling or {}).get("rope_type") == "dynamic"
        self._inv_freq = {torch.device("cpu"): inv_frequencies(config, local)}  # device -> [d/2]

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [T] (int64) -> cos, sin [T, head_dim] in `dtype`."""
        if self.dynamic:
            inv_freq = dynamic_inv_frequencies(self.config, positions)  # [T, d/2]
        else:
            inv_freq = self._inv_freq_on(positions.device)[None, :]  # [1, d/2]
        freqs = positions[:, None].float() * inv_freq  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _inv_freq_on(self, device: torch.device) -> Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        return self._inv_freq[device]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim], cos/sin [T, head_dim] -> x rotated, the half-split (NeoX) layout
    that Hugging Face Llama checkpoints are stored in."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, d]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
