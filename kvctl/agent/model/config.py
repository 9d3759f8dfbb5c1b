"""The shape of a Llama-family decoder, read from a Hugging Face `config.json`.

Llama, Mistral and Qwen2 checkpoints differ only in a few switches (q/k/v bias, rope scaling,
sliding window), so one frozen dataclass describes all three and one module runs them. Every
number is bounded and typed here, since the loader sizes everything after it from them.
"""

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvctl.agent.model.errors import CheckpointError

if TYPE_CHECKING:
    from kvctl.agent.model.chat_template import ChatTemplate

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SUPPORTED = "kvctl runs Llama, Mistral and Qwen2 style decoders"
_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# The largest value each size may take: several times the largest open models (Llama 3.1 405B:
# 126 layers, hidden 16,384, MLP 53,248, 128 heads; vocabularies of 256k; contexts of 10M), so a
# real checkpoint always fits and a hostile one cannot ask for a model it has no weights for.
LIMITS = {
    "num_hidden_layers": 1024,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 24,
}


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to build the decoder and size its KV cache.

    `attention_bias` puts a bias on q/k/v; `o_proj_bias` on the output projection (Llama's
    `attention_bias` sets both, Qwen2 has q/k/v bias only). `rope_scaling` is None for plain RoPE,
    else a dict with `rope_type` and that type's parameters. `sliding_window` is kept only when it
    is shorter than `max_position_embeddings`: attention here always spans the whole context, which
    equals sliding-window attention exactly while a sequence is no longer than the window, so such a
    model's usable context is `max_context_len`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    model_type: str = "llama"
    name: str = "model"
    sliding_window: int | None = None
    # turns chat messages into a prompt (chat_template.jinja, tokenizer_config.json, GGUF metadata)
    chat_template: "ChatTemplate | None" = field(default=None, repr=False)

    @property
    def max_context_len(self) -> int:
        """The longest sequence this runtime computes exactly like the reference model."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str) -> "ModelConfig":
        """Read a Hugging Face config dict; raise CheckpointError ("config.json: ...") when the
        checkpoint is not a Llama/Mistral/Qwen2 decoder this runtime computes faithfully."""
        if not isinstance(hf, dict):
            raise CheckpointError("config.json: expected a JSON object at the top level")
        model_type = _model_type(hf)
        _check_mlp(hf)
        num_heads = _size(hf, "num_attention_heads")
        hidden_size = _size(hf, "hidden_size")
        num_kv_heads = _size(hf, "num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        if hf.get("head_dim") is None and hidden_size < num_heads:
            raise CheckpointError(
                f"config.json: hidden_size {hidden_size} is smaller than num_attention_heads "
                f"{num_heads}, so head_dim would be 0; give head_dim"
            )
        head_dim = _size(hf, "head_dim", default=hidden_size // num_heads)
        if head_dim % 2:
            raise CheckpointError(f"config.json: head_dim {head_dim} must be even for RoPE")
        max_pos = _size(hf, "max_position_embeddings", default=2048)
        theta, rope_scaling = _rope(hf, max_pos)
        attention_bias = _flag(hf, "attention_bias")
        return cls(
            vocab_size=_size(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_size(hf, "intermediate_size"),
            num_layers=_size(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_number("rms_norm_eps", hf.get("rms_norm_eps") or 1e-6, below=1.0),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
            attention_bias=model_type == "qwen2" or attention_bias,
            o_proj_bias=model_type != "qwen2" and attention_bias,
            bos_token_id=_optional_int(hf, "bos_token_id"),
            eos_token_ids=token_ids(hf.get("eos_token_id"), "config.json", "eos_token_id"),
            torch_dtype=_dtype(hf),
            model_type=model_type,
            name=name,
            sliding_window=_sliding_window(hf, model_type, max_pos),
        )


def token_ids(value: Any, file: str, key: str) -> tuple[int, ...]:
    """An `eos_token_id`-style entry (null, an int or a list of ints) as a tuple."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CheckpointError(f"{file}: {key} must be an integer or a list of integers")
    return tuple(values)


def _model_type(hf: dict[str, Any]) -> str:
    known = set(ARCHITECTURES.values())
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise CheckpointError("config.json: architectures must be a list of names")
    for arch in architectures:
        if arch not in known:
            raise CheckpointError(
                f"config.json: unsupported architecture {_shown(arch)}; {_SUPPORTED}"
            )
    model_type = hf.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(f"config.json: model_type must be a name, got {_shown(model_type)}")
    for arch in architectures:
        implied = next(mt for mt, known_arch in ARCHITECTURES.items() if known_arch == arch)
        if model_type not in (None, implied):
            raise CheckpointError(
                f"config.json: architecture {arch!r} does not match model_type {model_type!r}"
            )
        model_type = implied
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"config.json: unsupported model_type {_shown(model_type)}; {_SUPPORTED}"
        )
    return model_type


def _check_mlp(hf: dict[str, Any]) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json: hidden_act {act!r} is not supported; expected 'silu'")
    if hf.get("mlp_bias"):
        raise CheckpointError("config.json: mlp_bias true is not supported by kvctl's decoder")


def _size(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    """A size from `LIMITS`: an integer from 1 to its limit, refused in one line otherwise."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"config.json: missing required key {key!r}")
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= LIMITS[key]:
        raise CheckpointError(
            f"config.json: {key} must be an integer from 1 to {LIMITS[key]:,}, got {_shown(value)}"
        )
    return value


def _number(key: str, value: Any, below: float = math.inf) -> float:
    """A positive, finite number under `below` (`value` is the entry or its default)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < below:
        limit = "" if below == math.inf else f" below {below}"
        raise CheckpointError(
            f"config.json: {key} must be a positive finite number{limit}, got {_shown(value)}"
        )
    return float(value)


def _flag(hf: dict[str, Any], key: str) -> bool:
    value = hf.get(key)
    if value is not None and not isinstance(value, bool):
        raise CheckpointError(f"config.json: {key} must be true or false, got {_shown(value)}")
    return bool(value)


def _shown(value: Any) -> str:
    """`value` for a one-line message, cut short: a hostile config's value may be huge."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge integer"
    return text if len(text) <= 40 else text[:37] + "..."


def _optional_int(hf: dict[str, Any], key: str) -> int | None:
    value = hf.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise CheckpointError(f"config.json: {key} must be an integer or null, got {value!r}")
    return value


def _dtype(hf: dict[str, Any]) -> str:
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if not isinstance(name, str) or name not in DTYPES:
        raise CheckpointError(
            f"config.json: dtype {_shown(name)} is not supported; "
            f"expected one of {', '.join(DTYPES)}"
        )
    return name


def _rope(hf: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the transformers-5 `rope_parameters` entry or the
    older top-level `rope_theta` + `rope_scaling` pair."""
    given = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(given, dict):
        raise CheckpointError("config.json: rope_scaling/rope_parameters must be an object")
    params = dict(given)
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    theta = _number("rope_theta", theta)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"config.json: rope type {_shown(rope_type)} is not supported; "
            f"kvctl supports {', '.join(ROPE_TYPES)}"
        )
    partial = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise CheckpointError("config.json: partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", max_pos)
    missing = [key for key in _ROPE_KEYS[rope_type] if params.get(key) is None]
    if missing:
        raise CheckpointError(f"config.json: rope type {rope_type!r} needs {', '.join(missing)}")
    for key in _ROPE_KEYS[rope_type]:
        _number(f"rope {key}", params[key])
    return theta, {"rope_type": rope_type, **params}


def _sliding_window(hf: dict[str, Any], model_type: str, max_pos: int) -> int | None:
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types") or []
    uses_window = (
        model_type == "mistral"
        or _flag(hf, "use_sliding_window")
        or (isinstance(layer_types, list) and "sliding_attention" in layer_types)
    )
    if not uses_window or window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise CheckpointError("config.json: sliding_window must be a positive integer or null")
    return window if window < max_pos else None
