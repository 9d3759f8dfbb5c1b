"""The built-in demo model: a small Llama with seeded random weights and a byte tokenizer.

It lets the agent run on any CPU with nothing to download, and it is a real decoder: same code
path, same KV-cache traffic per token as a checkpoint, just small. Weights come from a private
`torch.Generator`, drawn on the CPU in float32 in parameter order, so every build with the same
seed has bit-identical weights on every device and whatever the global RNG state.
"""

import math

import torch
from torch import Tensor

from kvctl.agent.model.config import ModelConfig
from kvctl.agent.model.llama import LlamaModel
from kvctl.agent.model.tokenizer import ByteTokenizer

# Logit scale of the output projection: large enough that greedy continuations depend on the
# prompt and sampling at temperature 1 is not uniform noise.
_LOGIT_SCALE = 4.0
# Output rows of non-printable bytes and specials are shrunk so generated text is mostly
# printable ASCII (and EOS is rare) instead of U+FFFD soup.
_QUIET_ROW_SCALE = 0.05
_PRINTABLE = range(32, 127)


def demo_config() -> ModelConfig:
    """About 3.2 M parameters; 32 KiB of K/V per token (float32, 4 layers × 4 KV heads × 32 × 2)."""
    tokenizer = ByteTokenizer()
    return ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.BOS,
        eos_token_ids=tokenizer.eos_token_ids,
        torch_dtype="float32",
        model_type="llama",
        name="demo",
    )


def build_demo_model(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    config: ModelConfig | None = None,
) -> tuple[ModelConfig, LlamaModel, ByteTokenizer]:
    """(config, model in eval mode on `device`, tokenizer); same seed, same weights. `config`
    (default `demo_config()`) gives another shape the same way, e.g. a real model's for a
    benchmark; the byte tokenizer only fits the demo's vocabulary."""
    config = config or demo_config()
    with torch.device("meta"):
        model = LlamaModel(config)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    state = {
        name: _init(name, tuple(param.shape), config, generator).to(device=device, dtype=dtype)
        for name, param in model.named_parameters()
    }
    model.load_state_dict(state, strict=True, assign=True)
    return config, model.eval().requires_grad_(False), ByteTokenizer()


def _init(name: str, shape: tuple[int, ...], config: ModelConfig, gen: torch.Generator) -> Tensor:
    """Scaled normal init: unit-variance activations through each block, residual branches damped
    by 1/sqrt(2 · layers) so the stream stays dominated by the token and its context."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    weight = torch.randn(shape, generator=gen) / math.sqrt(shape[1])  # std 1/sqrt(fan_in)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return weight / math.sqrt(2 * config.num_layers)
    if name == "lm_head.weight":
        row_scale = torch.full((shape[0], 1), _QUIET_ROW_SCALE)
        row_scale[list(_PRINTABLE)] = 1.0
        return weight * _LOGIT_SCALE * row_scale
    return weight
