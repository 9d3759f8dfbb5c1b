"""Rotary position embeddings, computed from each token's own position.

In a flattened paged batch every token carries its own position, so the rotation is a function of
a `positions` tensor [T] rather than of an offset and a length. The inverse frequencies follow
transformers' `ROPE_INIT_FUNCTIONS` formula for formula (same float32 operations in the same
order), so logits match the reference to float rounding. yarn and longrope also scale cos and sin
by their attention factor; `dynamic` and longrope, whose tables depend on a sequence's length,
take each token's own length (position + 1), so a token's rotation never depends on what else is
in the batch (docs/operations.md says where that differs from transformers).
"""

import math

import torch
from torch import Tensor

from kvctl.agent.model.config import ModelConfig


def inv_frequencies(config: ModelConfig, local: bool = False) -> Tensor:
    """Inverse frequencies [rotary_dim // 2] (float32, CPU) for positions inside the trained
    context; `local`: the sliding layers' own plain RoPE (`local_rope_theta`, Gemma 3).

    `dynamic` scaling only changes frequencies past `max_position_embeddings`; see
    `dynamic_inv_frequencies` for those.
    """
    dim = config.rotary_dim
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
    if scaling["rope_type"] == "yarn":
        return _yarn(config, exponents, scaling)
    if scaling["rope_type"] == "longrope":
        return _longrope(config, exponents, scaling["short_factor"])
    return inv_freq


def attention_scaling(config: ModelConfig) -> float:
    """The factor on cos and sin of yarn and longrope (1 for every other rope), as transformers
    computes it from `attention_factor` or the context factor."""
    scaling = config.rope_scaling or {"rope_type": "default"}
    kind, given = scaling["rope_type"], scaling.get("attention_factor")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if given is not None:
        return float(given)
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    if kind == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(config: ModelConfig, exponents: Tensor, scaling: dict) -> Tensor:
    """YaRN: interpolated frequencies (divided by `factor`) for the slow dimensions,
    extrapolated (as trained) for the fast ones, a linear ramp between `beta_slow` and
    `beta_fast` rotations over the original context (transformers' formula)."""
    dim, base = config.rotary_dim, config.rope_theta
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    pos_freqs = base**exponents
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no division by zero
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    keep = 1 - ramp  # the share of each dimension extrapolated
    return interpolation * (1 - keep) + extrapolation * keep


def _longrope(config: ModelConfig, exponents: Tensor, factors: list[float]) -> Tensor:
    """LongRoPE's frequencies under one set of per-dimension factors."""
    factor = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (factor * config.rope_theta**exponents)


def long_inv_frequencies(config: ModelConfig) -> Tensor:
    """LongRoPE's frequencies [rotary_dim // 2] for positions past the original context."""
    assert config.rope_scaling is not None
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return _longrope(config, exponents, config.rope_scaling["long_factor"])


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
    """Per-token inverse frequencies [T, rotary_dim // 2] for dynamic-NTK scaling.

    transformers rescales the base from the largest position in its forward call, which makes a
    token's rotation depend on what else is in the batch. Here each token uses its own length
    (position + 1): identical to transformers whenever the context is within
    `max_position_embeddings` and for one-token decode steps, and independent of batch composition.
    """
    assert config.rope_scaling is not None
    dim = config.rotary_dim
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
        kind = None if local else (config.rope_scaling or {}).get("rope_type")
        self.dynamic = kind == "dynamic"
        self.scale = 1.0 if local else attention_scaling(config)
        self._inv_freq = {torch.device("cpu"): inv_frequencies(config, local)}  # device -> [d/2]
        self._long: dict[torch.device, Tensor] | None = None
        if kind == "longrope":  # past the original context: the long factors
            assert config.rope_scaling is not None
            self._original = config.rope_scaling["original_max_position_embeddings"]
            self._long = {torch.device("cpu"): long_inv_frequencies(config)}

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [T] (int64) -> cos, sin [T, rotary_dim] in `dtype`."""
        if self.dynamic:
            inv_freq = dynamic_inv_frequencies(self.config, positions)  # [T, d/2]
        else:
            inv_freq = _on(self._inv_freq, positions.device)[None, :]  # [1, d/2]
        if self._long is not None:  # each token by its own length, as `dynamic` does
            long = (positions + 1 > self._original)[:, None]  # [T, 1]
            inv_freq = torch.where(long, _on(self._long, positions.device)[None, :], inv_freq)
        freqs = positions[:, None].float() * inv_freq  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def _on(tables: dict[torch.device, Tensor], device: torch.device) -> Tensor:
    """A frequency table on `device`, copied there once."""
    if device not in tables:
        tables[device] = tables[torch.device("cpu")].to(device)
    return tables[device]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim], cos/sin [T, rotary_dim] -> x with its first rotary_dim dimensions
    of each head rotated (the rest as they are), the half-split (NeoX) layout that Hugging Face
    Llama checkpoints are stored in."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, d]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
