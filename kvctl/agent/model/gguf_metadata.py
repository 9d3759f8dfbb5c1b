"""A GGUF file's metadata as Python values, and the `ModelConfig` it describes.

The llama.cpp keys are translated into a Hugging Face config dict and checked by
`ModelConfig.from_hf`, so a GGUF model is held to the same rules as a checkpoint directory.
"""

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvctl.agent.model.chat_template import ChatTemplate
from kvctl.agent.model.config import ModelConfig
from kvctl.agent.model.errors import CheckpointError
from kvctl.agent.model.rope import inv_frequencies

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # llama.cpp names; Mistral files are "llama"
_STRING, _ARRAY = 8, 9  # GGUFValueType
# Llama 3.1/3.2's rope scaling, which llama.cpp stores as a `rope_freqs.weight` tensor.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_CONTEXT = 8192


def read_metadata(reader: Any, file: str) -> dict[str, Any]:
    """Every key/value of the file: strings as str, numbers as Python scalars, arrays as lists."""
    meta = {}
    try:
        for key, field in reader.fields.items():
            meta[key] = _value(field)
    except (UnicodeDecodeError, IndexError) as exc:
        raise CheckpointError(f"{file}: corrupt metadata value ({exc})") from exc
    return meta


def _value(field: Any) -> Any:
    kind = field.types[0] if field.types else None
    if kind == _ARRAY:
        element = field.types[1] if len(field.types) > 1 else None
        return [_scalar(field.parts[i], element) for i in field.data]
    return _scalar(field.parts[field.data[0]], kind)


def _scalar(part: np.ndarray, kind: int | None) -> Any:
    if kind == _STRING:
        return bytes(part).decode("utf-8")
    if isinstance(part[0], np.floating):  # float32 1e-5 as 1e-5, not 9.99999974737875e-06
        return float(str(part[0]))
    return part[0].item()


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, Any], file: Path) -> ModelConfig:
    """The decoder the metadata and tensor names describe; CheckpointError when kvctl's model
    would not compute it faithfully."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{file.name}: unsupported architecture {arch!r}; kvctl loads GGUF files of "
            f"architecture {', '.join(ARCHITECTURES)} (Llama, Mistral, Qwen2 and Qwen3 decoders)"
        )
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{file.name}: missing tensor token_embd.weight")
    hf = _hf_config(meta, tensors, arch, file.name)
    try:
        config = ModelConfig.from_hf(hf, name=file.stem)
    except CheckpointError as exc:
        message = str(exc).replace("config.json:", f"{file.name}: metadata", 1)
        raise CheckpointError(message) from None
    if "rope_freqs.weight" in tensors:
        config = _with_llama3_rope(config, tensors["rope_freqs.weight"], file.name)
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return replace(
        config,
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
        chat_template=_chat_template(meta),
    )


def _chat_template(meta: dict[str, Any]) -> ChatTemplate | None:
    """The file's template, rendered with its own BOS and EOS texts (as transformers' GGUF
    loading does: the template writes BOS, so the rendered text is encoded without specials)."""
    source = meta.get("tokenizer.chat_template")
    if not isinstance(source, str) or not source:
        return None
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def text(kind: str) -> str:
        index = meta.get(f"tokenizer.ggml.{kind}_token_id")
        return str(tokens[index]) if isinstance(index, int) and 0 <= index < len(tokens) else ""

    return ChatTemplate(source, text("bos"), text("eos")).compile()


def _hf_config(meta: dict[str, Any], tensors: dict[str, Any], arch: str, file: str) -> dict:
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise CheckpointError(f"{file}: per-layer KV head counts are not supported")
        kv_heads = kv_heads[0]
    hidden = key("embedding_length")
    head_dim = key("attention.key_length") or (hidden // heads if hidden and heads else None)
    if key("attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{file}: attention.key_length and value_length differ")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(f"{file}: partial rotary embeddings are not supported")
    vocab = int(tensors["token_embd.weight"].shape[1])
    return {
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch, file),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "torch_dtype": _dtype(tensors),
    }


def _rope_scaling(meta: dict[str, Any], arch: str, file: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear")
    if kind == "none" and factor in (None, 1.0):
        return None
    if kind in ("none", "linear") and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    raise CheckpointError(f"{file}: rope scaling {kind!r} is not supported; kvctl supports linear")


def _dtype(tensors: dict[str, Any]) -> str:
    """The float type the weights are held in when no --dtype is given."""
    kinds = {t.tensor_type.name for t in tensors.values() if len(t.shape) > 1}
    if kinds <= {"F32"}:
        return "float32"
    return "bfloat16" if "BF16" in kinds else "float16"


def _with_llama3_rope(config: ModelConfig, tensor: Any, file: str) -> ModelConfig:
    """Llama 3.1's rope scaling, recognised from the per-frequency divisors llama.cpp stores."""
    if config.rope_scaling is not None or tensor.tensor_type.name != "F32":
        raise CheckpointError(f"{file}: rope_freqs.weight is not supported with this rope setup")
    factors = torch.from_numpy(np.array(tensor.data, dtype=np.float32).reshape(-1))
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        **_LLAMA3_ROPE,
        "original_max_position_embeddings": _LLAMA3_CONTEXT,
    }
    llama3 = replace(config, rope_scaling=scaling)
    base = inv_frequencies(config)
    if factors.shape != base.shape or not torch.allclose(
        inv_frequencies(llama3), base / factors, rtol=1e-5, atol=0
    ):
        raise CheckpointError(
            f"{file}: rope_freqs.weight holds rope factors other than Llama 3.1's; "
            "kvctl cannot reproduce them"
        )
    return llama3
