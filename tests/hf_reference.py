"""Tiny random Hugging Face checkpoints whose logits are peaked, for equivalence tests."""

import math

import torch

SHAPE = {  # a tiny decoder: 2 layers, 4 heads over 2 KV heads, vocabulary of 128
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
VARIANTS = {  # name: (transformers config class, model class, config fields)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True},
    ),
    "qwen2-qkv-bias": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # q/k norms over each head, an explicit head_dim other than hidden / heads, tied embeddings
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
    # q/k norms over the whole projection, norms after each sublayer instead of before it
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            "embedding_multiplier": 4.0,
            "attention_multiplier": 0.125,
            "residual_multiplier": 0.5,
            "logits_scaling": 2.0,
        },
    ),
    # qkv_proj and gate_up_proj stored fused
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    # Phi-4-mini's partial rope: the first 3/4 of each head rotate, the rest pass through
    "phi4-mini-partial": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"pad_token_id": 0, "partial_rotary_factor": 0.75, "tie_word_embeddings": True},
    ),
    # Phi-3's long-context rope within its original context (short factors, the attention factor
    # of 256 / 64); past it, tests/model/test_rope.py
    "phi3-longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "pad_token_id": 0,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [1.0 + 2.0 * i for i in range(8)],
            },
        },
    ),
    # YaRN as Qwen3 and gpt-oss use it
    "qwen3-yarn": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # mixtures of experts: Mixtral's names (block_sparse_moe, w1/w2/w3), top 2 of 4
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    # top 2 of 8 experts, renormalised, q/k norms, and its second layer dense
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    # Gemma 1: Llama's layer with (1 + w) norms, GeGLU, √hidden embeddings, tied embeddings and
    # an explicit head_dim (q wider than hidden, as in the 7B's 16 heads of 256 over 3,072)
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 32, "pad_token_id": 0}),
    # (1 + w) norms around each sublayer, GeGLU, √hidden embeddings, a query scale of its own,
    # soft-capped scores and logits, a sliding window of 8 tokens on every other layer
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "attn_logit_softcapping": 10.0,
            "final_logit_softcapping": 60.0,
            "pad_token_id": 0,
        },
    ),
    # per-head q/k norms, sliding layers with their own rope base: layers 0 and 2 slide
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
            "pad_token_id": 0,
        },
    ),
    # attention sinks, q/k/v/o biases, a sliding window of 8 tokens on every other layer, a
    # router with a bias choosing 2 of 4 experts with biases and a clamped SwiGLU (tight here,
    # 1.5, so the clamp bites), YaRN within its original context
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "swiglu_limit": 1.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
            "pad_token_id": 0,
        },
    ),
}
ROPE_ONLY = ("phi3-longrope", "qwen3-yarn")
"""Variants that differ from their family only in the rope's frequencies: checked through the
model, their serving paths are their family's."""
FAMILY_VARIANTS = sorted(v for v in VARIANTS if v not in ROPE_ONLY)
PROMPT_LENS = (5, 17, 1, 30)


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
            elif name.endswith("sinks"):  # sinks as large as the scores, so they matter
                param.copy_(1.0 + noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(noise)
            else:  # each output row over its inputs (the last dimension, experts' too)
                scale = 3.0 if name == "lm_head.weight" else 1.0
                param.copy_(noise * scale / math.sqrt(param.shape[-1]))


def reference_model(variant: str) -> torch.nn.Module:
    """The float32 transformers model of a `VARIANTS` entry, peaked weights seeded by its name."""
    import transformers

    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**SHAPE, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    peaked_weights(model, seed=len(variant))
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt: `new_tokens` ids, end-of-text ignored."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()
