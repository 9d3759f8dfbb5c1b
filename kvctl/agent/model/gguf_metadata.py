"""A GGUF file's metadata as Python values, and the `ModelConfig` it describes.

The llama.cpp keys are translated into a Hugging Face config dict and checked by
`ModelConfig.from_hf`, so a GGUF model is held to the same rules as a checkpoint directory.
"""

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvctl.agent.model.chat_template import ChatTemplate
from kvctl.agent.model.config import LIMITS, ModelConfig
from kvctl.agent.model.errors import CheckpointError
from kvctl.agent.model.rope import inv_frequencies

ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "gpt-oss",
)
"""llama.cpp's names (Mistral's files are "llama")."""
_FAMILIES = (
    "Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Phi-3, Gemma, Gemma 2, Gemma 3 and gpt-oss text "
    "decoders"
)
LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
"""Phi-3's longrope factors, which llama.cpp stores as tensors; folded into the config."""
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
"""Hugging Face's model_type where it is not llama.cpp's architecture."""
GEMMA = ("gemma", "gemma2", "gemma3")
"""Architectures whose norm weights llama.cpp's converter stores as 1 + w (`gguf_loader`)."""
SANDWICH = ("gemma2", "gemma3")
"""Those with a norm before and after each sublayer, whose `ffn_norm` is the MLP's input norm."""
# What llama.cpp's gemma2/gemma3 hparams loading assumes where a file says nothing: every Nth layer
# attends to the whole context (layer i slides iff i % N < N - 1), Gemma 2's window and caps, Gemma
# 3's sliding layers' rope base, and the layer count of the 27B model, the one whose query scale is
# 1 / sqrt(hidden / heads) instead of 1 / sqrt(key_length).
_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA2_WINDOW = 4096
_GEMMA2_CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_GEMMA3_LOCAL_BASE = 10000.0
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
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
            f"architecture {', '.join(ARCHITECTURES)} ({_FAMILIES})"
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
    if arch == "phi3" and LONGROPE_FACTORS[0] in tensors:
        config = _with_longrope(config, meta, tensors, file.name)
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
    rotated = key("rope.dimension_count", head_dim)
    if rotated != head_dim and arch != "phi3":
        raise CheckpointError(f"{file}: partial rotary embeddings are not supported")
    vocab = int(tensors["token_embd.weight"].shape[1])
    hf = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": None if arch == "gpt-oss" else _rope_scaling(meta, arch, file),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "torch_dtype": _dtype(tensors),
    }
    if arch in GEMMA:
        hf.update(_gemma(meta, tensors, arch, file, hf))
    if arch == "phi3":  # Phi-4-mini rotates part of each head; Phi-3 mini slides a window
        if isinstance(rotated, int) and isinstance(head_dim, int) and head_dim > 0:
            hf["partial_rotary_factor"] = rotated / head_dim
        hf["sliding_window"] = key("attention.sliding_window") or None
    if arch == "gpt-oss":
        hf.update(_gpt_oss(meta, tensors, hf))
    if arch == "qwen3moe":  # llama.cpp's qwen3moe: every layer routed, the top k renormalised
        hf.update(
            num_experts=key("expert_count"),
            num_experts_per_tok=key("expert_used_count"),
            moe_intermediate_size=key("expert_feed_forward_length"),
            norm_topk_prob=True,
        )
        hf["intermediate_size"] = hf["intermediate_size"] or hf["moe_intermediate_size"]
    return hf


def _gemma(
    meta: dict[str, Any], tensors: dict[str, Any], arch: str, file: str, hf: dict[str, Any]
) -> dict[str, Any]:
    """The Gemma keys of the config, read as llama.cpp's gemma/gemma2/gemma3 code reads the file
    its convert_hf_to_gguf writes; CheckpointError where the file asks for something llama.cpp
    would compute otherwise, or kvctl cannot. Gemma 1 needs only its GELU: llama.cpp's gemma
    scales queries by 1 / sqrt(key_length), slides no window and caps nothing."""

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    if arch in ("gemma", "gemma2") and "output.weight" in tensors:
        raise CheckpointError(
            f"{file}: unexpected tensor output.weight; llama.cpp's {arch} ties the output "
            "to token_embd.weight"
        )
    if arch == "gemma":
        return {"hidden_activation": "gelu_pytorch_tanh"}

    layers, hidden, heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    gemma: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",  # llama.cpp's LLM_FFN_GELU is the tanh one
        "query_pre_attn_scalar": hf["head_dim"],
        **_sliding(key, arch, file, layers),
    }
    if layers == _LAYERS_27B[arch] and isinstance(hidden, int) and isinstance(heads, int):
        gemma["query_pre_attn_scalar"] = hidden // heads if heads > 0 else None
    if arch == "gemma2":
        window = key("attention.sliding_window")
        gemma["sliding_window"] = _GEMMA2_WINDOW if window is None else window
        gemma.update({name: key(name, cap) for name, cap in _GEMMA2_CAPS.items()})
        if key("rope.freq_base_swa", hf["rope_theta"]) != hf["rope_theta"]:
            raise CheckpointError(
                f"{file}: gemma2.rope.freq_base_swa is not supported; llama.cpp's gemma2 rotates "
                "every layer with rope.freq_base"
            )
        return gemma
    if key("attn_logit_softcapping") is not None:
        raise CheckpointError(
            f"{file}: gemma3.attn_logit_softcapping is not supported; llama.cpp's gemma3 does not "
            "soft-cap attention scores"
        )
    window = key("attention.sliding_window") or None  # absent or 0: no layer slides
    gemma["sliding_window"] = window
    gemma["final_logit_softcapping"] = key("final_logit_softcapping") or None  # 0: none
    # llama.cpp rotates with the sliding base only where layers slide (None: not the default)
    local = key("rope.freq_base_swa", _GEMMA3_LOCAL_BASE) if window is not None else None
    gemma["rope_local_base_freq"] = local
    return gemma


def _gpt_oss(meta: dict[str, Any], tensors: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's keys as llama.cpp's gpt-oss reads them: its experts, every other layer sliding
    from the first (`set_swa_pattern(2)`), YaRN without truncation (transformers'
    GptOssConfig), biases on q/k/v/o; the SwiGLU clamp and gain are llama.cpp's constants,
    which are transformers' defaults."""

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"gpt-oss.{name}", default)

    layers = hf["num_hidden_layers"]
    keys: dict[str, Any] = {
        "num_local_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "intermediate_size": key("expert_feed_forward_length") or hf["intermediate_size"],
        "sliding_window": key("attention.sliding_window"),
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    if isinstance(layers, int) and 0 < layers <= LIMITS["num_hidden_layers"]:
        kinds = ("sliding_attention", "full_attention")
        keys["layer_types"] = [kinds[i % 2] for i in range(layers)]
    if key("rope.scaling.type", "none") == "yarn":
        keys["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": key("rope.scaling.factor"),
            "original_max_position_embeddings": key("rope.scaling.original_context_length"),
            "beta_fast": key("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": key("rope.scaling.yarn_beta_slow", 1.0),
            "truncate": False,
        }
    return keys


def _sliding(key: Callable[[str, Any], Any], arch: str, file: str, layers: Any) -> dict[str, Any]:
    """`layer_types` from llama.cpp's `set_swa_pattern(N)`: layer i slides iff N is 0 or
    i % N < N - 1. Gemma 2's N is always 2; Gemma 3's 6 unless the file gives one number."""
    name = f"{arch}.attention.sliding_window_pattern"
    pattern = key("attention.sliding_window_pattern", _PATTERN[arch])
    if arch == "gemma2" and pattern != _PATTERN[arch]:
        raise CheckpointError(
            f"{file}: {name} {_brief(pattern)} is not supported; llama.cpp's gemma2 slides the "
            "window on every other layer"
        )
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 0:
        raise CheckpointError(
            f"{file}: {name} {_brief(pattern)} is not supported; kvctl reads one number of layers"
        )
    if not isinstance(layers, int) or not 0 < layers <= LIMITS["num_hidden_layers"]:
        return {}  # refused by ModelConfig.from_hf
    return {
        "layer_types": [
            "sliding_attention" if pattern == 0 or i % pattern < pattern - 1 else "full_attention"
            for i in range(layers)
        ]
    }


def _brief(value: Any) -> str:
    """`value` for a one-line message, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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


def _with_longrope(
    config: ModelConfig, meta: dict[str, Any], tensors: dict[str, Any], file: str
) -> ModelConfig:
    """Phi-3's longrope (the 128k releases, Phi-4-mini) from the factor tensors llama.cpp
    stores and its `rope.scaling` keys; checked as a config.json's would be."""
    if config.rope_scaling is not None or LONGROPE_FACTORS[1] not in tensors:
        raise CheckpointError(f"{file}: rope_factors_long.weight needs rope_factors_short.weight")
    long, short = (
        np.array(tensors[name].data, dtype=np.float32).reshape(-1).tolist()
        for name in LONGROPE_FACTORS
    )
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": long,
        "short_factor": short,
        "original_max_position_embeddings": meta.get("phi3.rope.scaling.original_context_length"),
    }
    if meta.get("phi3.rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = meta["phi3.rope.scaling.attn_factor"]
    hf = {
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "partial_rotary_factor": config.partial_rotary_factor,
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
    }
    try:
        checked = ModelConfig.from_hf(hf, config.name)
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace("config.json:", f"{file}:", 1)) from None
    return replace(config, rope_scaling=checked.rope_scaling)


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
