"""Tiny random Hugging Face checkpoints whose logits are peaked, for equivalence tests."""

import math

import torch


def peaked_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter (biases and norms too) from a seeded generator with scales that
    give peaked logits, so a wrong K/V read, bias, rope frequency or head grouping moves the
    argmax instead of hiding under near-uniform logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(noise)
            else:
                scale = 3.0 if name == "lm_head.weight" else 1.0
                param.copy_(noise * scale / math.sqrt(param.shape[1]))
