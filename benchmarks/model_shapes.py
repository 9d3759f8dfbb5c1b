"""Shapes of real models, for benchmarks that need a model's cost without its checkpoint: the
weights are drawn from a seed (`build_demo_model(config=...)`), nothing is downloaded."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvctl.agent.model import ModelConfig, build_demo_model
from kvctl.agent.model.demo import demo_config

MODELS = ("demo", "135m")


def smollm_135m_shape() -> ModelConfig:
    """SmolLM-135M's configuration: hidden 576, 30 layers, 9 heads, 3 KV heads, head dim 64,
    intermediate 1536, vocabulary 49,152, tied embeddings (134.5 M parameters)."""
    return replace(
        demo_config(),
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        name="smollm-135m-shape",
    )


def benchmark_model(name: str) -> tuple:
    """(config, model, tokenizer) of `--model demo|135m`: fp32 on the CPU, weights from seed 0;
    the 135M shapes have no tokenizer (the demo's bytes do not cover their vocabulary)."""
    config = smollm_135m_shape() if name == "135m" else None
    model_config, model, tokenizer = build_demo_model("cpu", torch.float32, seed=0, config=config)
    return model_config, model, tokenizer if config is None else None
