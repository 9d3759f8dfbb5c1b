"""The model half of the agent's runtime: a Llama-family decoder over flattened batches, the
attention-backend protocol through which it reads and writes its KV cache, the contiguous
baseline cache, checkpoint loading, tokenizers, sampling and the built-in demo model."""

from kvctl.agent.model.attention import (
    AttentionBackend,
    BatchLayout,
    attend_decode,
    attend_one,
    key_mask,
    split_by_sequence,
)
from kvctl.agent.model.config import ModelConfig
from kvctl.agent.model.contiguous_cache import ContiguousKVCache
from kvctl.agent.model.demo import build_demo_model, demo_config
from kvctl.agent.model.errors import CheckpointError, KVCacheFull
from kvctl.agent.model.llama import LlamaModel
from kvctl.agent.model.loader import load_checkpoint
from kvctl.agent.model.rope import RotaryEmbedding, apply_rotary, inv_frequencies
from kvctl.agent.model.sampling import Sampler, SamplingParams
from kvctl.agent.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "AttentionBackend",
    "BatchLayout",
    "ByteTokenizer",
    "CheckpointError",
    "ContiguousKVCache",
    "HFTokenizer",
    "KVCacheFull",
    "LlamaModel",
    "ModelConfig",
    "RotaryEmbedding",
    "Sampler",
    "SamplingParams",
    "Tokenizer",
    "apply_rotary",
    "attend_decode",
    "attend_one",
    "build_demo_model",
    "demo_config",
    "inv_frequencies",
    "key_mask",
    "load_checkpoint",
    "split_by_sequence",
]
