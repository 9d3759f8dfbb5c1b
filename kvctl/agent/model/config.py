"""The shape of a Llama-family decoder, read from a Hugging Face `config.json`.

Llama, Mistral, Qwen2, Qwen3, OLMo 2, Granite, Phi-3, Gemma 1/2/3 and gpt-oss checkpoints differ
only in a few switches (q/k/v bias, q/k norms, where the norms sit and how they scale, the MLP's
activation, Granite's multipliers, fused checkpoint tensors, rope scaling, which layers slide a
window, logit soft-capping, attention sinks, the experts' form: `Family`), so one frozen
dataclass describes them all and one module runs them.
Every number is bounded and typed here, since the loader sizes everything after it from them.
"""

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from kvctl.agent.model.errors import CheckpointError

if TYPE_CHECKING:
    from kvctl.agent.model.chat_template import ChatTemplate

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


@dataclass(frozen=True)
class Family:
    """How a family's decoder differs from Llama's; every family is Llama's block with some of
    these switches."""

    qkv_bias_only: bool = False
    """`attention_bias` means a bias on q/k/v and none on o (Qwen2 always has it)."""
    qk_norm: str | None = None
    """RMSNorm of q and k before the rotation: over each head ("head", Qwen3) or over the
    whole projection ("projection", OLMo 2)."""
    post_norms: bool = False
    """Norms on each sublayer's output before its residual add, and none on its input (OLMo 2)."""
    fused_checkpoint: bool = False
    """The checkpoint stores `qkv_proj` and `gate_up_proj` (Phi-3), split at load."""
    multipliers: bool = False
    """Granite's embedding, attention, residual and logits multipliers."""
    attention_bias: bool = True
    """`attention_bias` in config.json applies (Phi-3's projections never have a bias)."""
    experts: str | None = None
    """A mixture of experts, read from config.json the way this family names it ("mixtral":
    `num_local_experts`, experts the size of `intermediate_size`, always renormalised;
    "qwen3_moe": `num_experts`, `moe_intermediate_size`, `norm_topk_prob`, dense layers;
    "gpt_oss": Mixtral's counts, a router with a bias, the softmax over the chosen experts'
    logits, experts with biases and a clamped SwiGLU, stored as stacked tensors)."""
    sinks: bool = False
    """A learned sink logit per query head in each attention softmax's denominator (gpt-oss)."""
    float32_norms: bool = False
    """The layer and final norms multiply in float32 and round once in any dtype (gpt-oss's
    norm: the weight times float32 rows, then the rows' dtype)."""
    renames: tuple[tuple[str, str], ...] = ()
    """(the model's name, the checkpoint's) for parts of a layer the family names its own way."""
    gemma: bool = False
    """Gemma's decoder: norms scale by (1 + w) in float32, a GeGLU MLP (tanh GELU), embeddings
    scaled by √hidden in the model's dtype."""
    sandwich: bool = False
    """A norm after each sublayer too, before its residual add (Gemma 2 and 3: there
    `post_attention_layernorm` norms the attention's output and `pre_feedforward_layernorm` the
    MLP's input), and what came with it in Gemma 2: the query scale from `query_pre_attn_scalar`,
    scores and logits soft-capped where the config asks. Gemma 1 has none of these: its layer is
    Llama's with Gemma's norms, and transformers' Gemma ignores those keys in its config."""
    sliding: str = "flagged"
    """When `sliding_window` applies and to which layers, where no `layer_types` list says:
    "flagged" (Qwen's: only with `use_sliding_window`, layers from `max_window_layers` on),
    "always" (Mistral's: every layer, whenever a window is given), or "every N" (Gemma's:
    always, layer i slides unless (i + 1) % N == 0, N from `sliding_window_pattern`)."""


FAMILIES = {
    "llama": Family(),
    "mistral": Family(sliding="always"),
    "qwen2": Family(qkv_bias_only=True),
    "qwen3": Family(qk_norm="head"),
    "olmo2": Family(qk_norm="projection", post_norms=True),
    "granite": Family(multipliers=True),
    "phi3": Family(fused_checkpoint=True, attention_bias=False, sliding="always"),
    "mixtral": Family(
        experts="mixtral",
        sliding="always",
        renames=(
            ("mlp.gate.", "block_sparse_moe.gate."),
            ("gate_proj.", "w1."),
            ("down_proj.", "w2."),
            ("up_proj.", "w3."),
            ("mlp.experts.", "block_sparse_moe.experts."),
        ),
    ),
    "qwen3_moe": Family(qk_norm="head", experts="qwen3_moe"),
    "gemma": Family(gemma=True),
    "gemma2": Family(gemma=True, sandwich=True, sliding="every 2"),
    "gemma3_text": Family(gemma=True, sandwich=True, qk_norm="head", sliding="every 6"),
    "gpt_oss": Family(experts="gpt_oss", sinks=True, sliding="every 2", float32_norms=True),
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SUPPORTED = (
    "kvctl runs Llama, Mistral, Qwen2, Qwen3, OLMo 2, Granite, Phi-3, Gemma, Gemma 2 and Gemma 3 "
    "style decoders, and Mixtral, Qwen3-MoE and gpt-oss mixtures of experts"
)
_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("factor", "original_max_position_embeddings"),
}
_OPTIONAL_ROPE_KEYS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
"""Numbers yarn and longrope may give; transformers' defaults apply where they are missing."""
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
    "num_local_experts": 1024,
    "num_experts": 1024,
    "num_experts_per_tok": 1024,
    "moe_intermediate_size": 1 << 20,
    "decoder_sparse_step": 1024,
}


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to build the decoder and size its KV cache.

    `attention_bias` puts a bias on q/k/v; `o_proj_bias` on the output projection (Llama's
    `attention_bias` sets both, Qwen2 has q/k/v bias only). `rope_scaling` is None for plain RoPE,
    else a dict with `rope_type` and that type's parameters. `sliding_window` is kept only when it
    is shorter than `max_position_embeddings`; the layers in `sliding_layers` then attend to the
    last `sliding_window` tokens only (a query at position p sees keys p - window + 1 .. p), the
    others to the whole context. `sliding_layers` are listed also without such a window when
    they rotate with a rope of their own: `local_rope_theta`, the sliding layers' base where the
    family gives them one (Gemma 3; plain RoPE, no scaling). `attn_softcap` and `final_softcap`
    cap attention scores and logits as c · tanh(x / c) (Gemma 2).
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
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embedding_multiplier: float = 1.0  # Granite's multipliers; 1.0 elsewhere
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # None: 1 / sqrt(head_dim)
    logits_scaling: float = 1.0  # logits are divided by it
    num_experts: int = 0  # a mixture of experts (`moe.py`) when > 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of a mixture-of-experts model with a dense MLP
    swiglu_limit: float = 7.0  # gpt-oss's experts: gate clamped above, up on both sides
    swiglu_alpha: float = 1.702  # and the sigmoid's gain
    mxfp4_experts: bool = False  # the checkpoint stores the experts in MXFP4 blocks and scales
    multimodal: bool = False  # the language model of a multimodal checkpoint (`LANGUAGE_MODELS`)
    partial_rotary_factor: float = 1.0  # the share of each head the rope rotates (Phi-4-mini)
    # turns chat messages into a prompt (chat_template.jinja, tokenizer_config.json, GGUF metadata)
    chat_template: "ChatTemplate | None" = field(default=None, repr=False)

    @property
    def max_context_len(self) -> int:
        """The longest sequence this runtime computes exactly like the reference model."""
        return self.max_position_embeddings

    def window_of(self, layer: int) -> int | None:
        """The keys a query of `layer` sees back from itself (itself included), or None: all."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head the rope rotates (all but with
        `partial_rotary_factor`); the rest pass through, as transformers' Phi-3 does."""
        return int(self.head_dim * self.partial_rotary_factor)

    def local_rope(self, layer: int) -> bool:
        """Whether `layer` rotates with the sliding layers' own rope (`local_rope_theta`)."""
        return self.local_rope_theta is not None and layer in self.sliding_layers

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def attention_sinks(self) -> bool:
        return self.family.sinks

    def describe(self) -> str:
        """One line for the start-up log: the family and how its layers attend."""
        family, extras = self.family, []
        if family.qk_norm is not None:
            extras.append(f"q/k norms over each {self.family.qk_norm}")
        if family.post_norms:
            extras.append("norms after each sublayer")
        if family.multipliers:
            extras.append("Granite's multipliers")
        if family.sandwich:
            extras.append("Gemma's norms around each sublayer and GeGLU")
        elif family.gemma:
            extras.append("Gemma's (1 + w) norms and GeGLU")
        if self.attn_softcap is not None or self.final_softcap is not None:
            caps = (self.attn_softcap, self.final_softcap)
            extras.append(
                "soft-capped "
                + " and ".join(
                    name for name, cap in zip(("attention", "logits"), caps, strict=True) if cap
                )
            )
        if self.num_experts:
            extras.append(f"{self.experts_per_token} of {self.num_experts} experts per token")
        if self.mxfp4_experts:
            extras.append("experts stored in MXFP4")
        if self.attention_sinks:
            extras.append("attention sinks")
        shape = (
            f"{self.num_layers} layers, {self.num_heads} query heads over {self.num_kv_heads} "
            f"KV heads of {self.head_dim}"
        )
        context = f"up to {self.max_position_embeddings:,} tokens"
        sliding = len(self.sliding_layers) if self.sliding_window is not None else 0
        if not sliding:
            attention = f"full attention on every layer {context}"
        elif sliding == self.num_layers:
            attention = f"a sliding window of {self.sliding_window:,} tokens on every layer"
            attention += f" {context}"
        else:
            attention = (
                f"a sliding window of {self.sliding_window:,} tokens on {sliding} of "
                f"{self.num_layers} layers, full attention on the others {context}"
            )
        return f"{ARCHITECTURES[self.model_type]}: {', '.join([shape, *extras])}; {attention}"

    @property
    def query_scale(self) -> float:
        """The factor on q that turns attention's 1 / sqrt(head_dim) into the model's own scale."""
        if self.attention_multiplier is None:
            return 1.0
        return self.attention_multiplier * math.sqrt(self.head_dim)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str) -> "ModelConfig":
        """Read a Hugging Face config dict; raise CheckpointError ("config.json: ...") when the
        checkpoint is not a decoder of a family this runtime computes faithfully (`FAMILIES`)."""
        if not isinstance(hf, dict):
            raise CheckpointError("config.json: expected a JSON object at the top level")
        hf, multimodal = _language_model(hf)
        model_type = _model_type(hf)
        family = FAMILIES[model_type]
        _check_mlp(hf, family, model_type)
        if hf.get("use_bidirectional_attention"):
            raise CheckpointError(
                "config.json: use_bidirectional_attention is not supported: an embedding model's "
                "attention looks both ways, and this runtime generates with causal attention"
            )
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
        partial = _partial_rotary(hf, head_dim)
        theta, rope_scaling, local_theta = _ropes(hf, max_pos, int(head_dim * partial))
        num_layers = _size(hf, "num_hidden_layers")
        window = _sliding_window(hf, family, max_pos)
        attention_bias = family.attention_bias and _flag(hf, "attention_bias")
        return cls(
            vocab_size=_size(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_size(hf, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_number("rms_norm_eps", hf.get("rms_norm_eps") or 1e-6, below=1.0),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
            attention_bias=model_type == "qwen2" or attention_bias,
            o_proj_bias=not family.qkv_bias_only and attention_bias,
            bos_token_id=_optional_int(hf, "bos_token_id"),
            eos_token_ids=token_ids(hf.get("eos_token_id"), "config.json", "eos_token_id"),
            torch_dtype=_dtype(hf),
            model_type=model_type,
            name=name,
            sliding_window=window,
            sliding_layers=(
                _sliding_layers(hf, family, num_layers)
                if window is not None or local_theta is not None
                else ()
            ),
            local_rope_theta=local_theta,
            attn_softcap=_softcap(hf, "attn_logit_softcapping") if family.sandwich else None,
            final_softcap=_softcap(hf, "final_logit_softcapping") if family.sandwich else None,
            **_multipliers(hf, family, hidden_size, head_dim),
            **_experts(hf, family),
            mxfp4_experts=_mxfp4(hf, family),
            multimodal=multimodal,
            partial_rotary_factor=partial,
        )


LANGUAGE_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
"""Multimodal architectures whose language model kvctl serves alone, text in and text out: the
config's `text_config`, the tensors under `language_model.` (the vision tower's are ignored)."""
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {  # transformers' GemmaConfig: the 2024 releases omit what equals these
        "vocab_size": 256000,
        "hidden_size": 3072,
        "intermediate_size": 24576,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
    "gemma2": {  # the releases leave out Gemma2Config's tied embeddings and ship no lm_head
        "tie_word_embeddings": True,
    },
    "gemma3_text": {  # transformers' Gemma3TextConfig: real text_configs omit what equals these
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
    "gpt_oss": {  # transformers' GptOssConfig
        "num_hidden_layers": 36,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "sliding_window": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "attention_bias": True,
    },
}
"""What transformers' config class of a family assumes where config.json says nothing."""


def _language_model(hf: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the decoder's config, whether it is a multimodal checkpoint's language model); the
    family's defaults filled in."""
    architectures = hf.get("architectures")
    names = architectures if isinstance(architectures, list) else []
    if any(isinstance(a, str) and a in LANGUAGE_MODELS for a in names):
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError("config.json: a multimodal checkpoint needs a text_config object")
        inherited: dict[str, Any] = {
            k: hf[k] for k in ("torch_dtype", "dtype", "tie_word_embeddings") if k in hf
        }
        language = [LANGUAGE_MODELS.get(a, a) for a in names if isinstance(a, str)]
        return _with_defaults({**inherited, **text, "architectures": language}), True
    return _with_defaults(hf), False


def _with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` with its family's `DEFAULTS` where it says nothing."""
    model_type = hf.get("model_type")
    if model_type is None and isinstance(hf.get("architectures"), list):
        model_type = next((t for t, a in ARCHITECTURES.items() if a in hf["architectures"]), None)
    defaults = DEFAULTS.get(model_type) if isinstance(model_type, str) else None
    return {**defaults, **hf} if defaults else hf


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


class _Multipliers(TypedDict):
    embedding_multiplier: float
    residual_multiplier: float
    attention_multiplier: float | None
    logits_scaling: float


def _multipliers(
    hf: dict[str, Any], family: Family, hidden_size: int, head_dim: int
) -> _Multipliers:
    """Granite's four multipliers (each defaults to transformers' GraniteConfig default), Gemma's
    two (embeddings times √hidden; from Gemma 2 on, queries scaled by 1 / √query_pre_attn_scalar,
    Gemma 1's by the usual 1 / √head_dim); the neutral values for every other family."""
    if family.gemma:
        scalar = hf.get("query_pre_attn_scalar") or head_dim
        return _Multipliers(
            embedding_multiplier=math.sqrt(hidden_size),
            residual_multiplier=1.0,
            attention_multiplier=(
                _number("query_pre_attn_scalar", scalar) ** -0.5 if family.sandwich else None
            ),
            logits_scaling=1.0,
        )
    if not family.multipliers:
        return _Multipliers(
            embedding_multiplier=1.0,
            residual_multiplier=1.0,
            attention_multiplier=None,
            logits_scaling=1.0,
        )
    return _Multipliers(
        embedding_multiplier=_number("embedding_multiplier", hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=_number("residual_multiplier", hf.get("residual_multiplier", 1.0)),
        attention_multiplier=_number("attention_multiplier", hf.get("attention_multiplier", 1.0)),
        logits_scaling=_number("logits_scaling", hf.get("logits_scaling", 1.0)),
    )


class _Experts(TypedDict, total=False):
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    dense_layers: tuple[int, ...]
    swiglu_limit: float
    swiglu_alpha: float


def _experts(hf: dict[str, Any], family: Family) -> _Experts:
    """The mixture of experts of a family that has one, read as transformers reads it."""
    if family.experts is None:
        return _Experts()
    layers = _size(hf, "num_hidden_layers")
    if family.experts in ("mixtral", "gpt_oss"):
        count = _expert_count(hf, "num_local_experts", 8, layers)
        top_k = _size(hf, "num_experts_per_tok", default=2)
        experts = _Experts(
            num_experts=count,
            experts_per_token=_top_k(top_k, count),
            moe_intermediate_size=_size(hf, "intermediate_size"),
        )
        if family.experts == "gpt_oss":
            experts["swiglu_limit"] = _number("swiglu_limit", hf.get("swiglu_limit", 7.0))
            experts["swiglu_alpha"] = _number("swiglu_alpha", hf.get("swiglu_alpha", 1.702))
        return experts
    # transformers 4 writes `num_experts`, transformers 5 `num_local_experts`
    key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    count = _expert_count(hf, key, 128, layers)
    step = _size(hf, "decoder_sparse_step", default=1)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise CheckpointError("config.json: mlp_only_layers must be a list of layer numbers")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return _Experts(
        num_experts=count,
        experts_per_token=_top_k(_size(hf, "num_experts_per_tok", default=8), count),
        moe_intermediate_size=_size(hf, "moe_intermediate_size"),
        norm_topk_prob=_flag(hf, "norm_topk_prob"),
        dense_layers=dense,
    )


MAX_EXPERT_MLPS = 1 << 16
"""Experts over all layers: four times the largest open models (DeepSeek-V3's 61 × 256,
Qwen3-235B's 94 × 128), so a hostile config cannot make the checks themselves list millions of
tensors before the memory check refuses them."""


def _expert_count(hf: dict[str, Any], key: str, default: int, layers: int) -> int:
    count = _size(hf, key, default=default)
    if count * layers > MAX_EXPERT_MLPS:
        raise CheckpointError(
            f"config.json: {count:,} experts on each of {layers:,} layers is over the "
            f"{MAX_EXPERT_MLPS:,} expert MLPs kvctl loads"
        )
    return count


def _top_k(top_k: int, count: int) -> int:
    if top_k > count:
        raise CheckpointError(
            f"config.json: num_experts_per_tok {top_k} is more than the {count} experts"
        )
    return top_k


MXFP4_BLOCK = 32
"""Values per MXFP4 block: 16 bytes of two 4-bit values each, under one shared exponent."""


def _mxfp4(hf: dict[str, Any], family: Family) -> bool:
    """Whether the experts are stored in MXFP4 (gpt-oss's releases, `quantization_config`); any
    other quantization is refused in one line, as kvctl computes in the weights' float dtype."""
    quantization = hf.get("quantization_config")
    if quantization is None:
        return False
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method != "mxfp4" or family.experts != "gpt_oss":
        raise CheckpointError(
            f"config.json: quantization {_shown(method)} is not supported; kvctl loads float "
            "weights, and gpt-oss's MXFP4 experts"
        )
    for key in ("intermediate_size", "hidden_size"):
        if _size(hf, key) % MXFP4_BLOCK:
            raise CheckpointError(
                f"config.json: {key} must be a multiple of {MXFP4_BLOCK} for MXFP4 experts"
            )
    return True


GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
"""The names of the tanh-approximated GELU of Gemma's GeGLU (transformers' `ACT2FN`)."""


def _check_mlp(hf: dict[str, Any], family: Family, model_type: str) -> None:
    if family.gemma:  # Gemma 2/3 read `hidden_activation`; older configs carry `hidden_act`
        legacy = hf.get("hidden_act")
        if model_type == "gemma" and legacy == "gelu":
            legacy = GELU_TANH[0]  # Gemma 1's releases: "gelu", read as tanh by transformers
        act = hf.get("hidden_activation") or legacy or GELU_TANH[0]
        if act not in GELU_TANH:
            raise CheckpointError(
                f"config.json: hidden_activation {_shown(act)} is not supported; expected "
                f"{GELU_TANH[0]!r}"
            )
    else:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(
                f"config.json: hidden_act {_shown(act)} is not supported; expected 'silu'"
            )
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


def _ropes(
    hf: dict[str, Any], max_pos: int, rotary_dim: int
) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, the sliding layers' own rope base or None). Gemma 3 gives its
    sliding layers plain RoPE of their own base: transformers 5 writes `rope_parameters` per
    layer type, older configs `rope_local_base_freq` beside the full layers' rope."""
    given = hf.get("rope_parameters")
    if isinstance(given, dict) and "full_attention" in given:
        local = given.get("sliding_attention")
        if local is not None and not isinstance(local, dict):
            raise CheckpointError(
                "config.json: rope_parameters.sliding_attention must be an object"
            )
        theta, scaling = _rope({"rope_parameters": given["full_attention"]}, max_pos, rotary_dim)
        if local is None:
            return theta, scaling, None
        local_theta, local_scaling = _rope({"rope_parameters": local}, max_pos, rotary_dim)
        if local_scaling is not None:
            raise CheckpointError("config.json: rope scaling on sliding layers is not supported")
        return theta, scaling, local_theta
    theta, scaling = _rope(hf, max_pos, rotary_dim)
    local_base = hf.get("rope_local_base_freq")
    if local_base is None:
        return theta, scaling, None
    return theta, scaling, _number("rope_local_base_freq", local_base)


def _rope(hf: dict[str, Any], max_pos: int, rotary_dim: int) -> tuple[float, dict[str, Any] | None]:
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
    params.pop("partial_rotary_factor", None)  # `_partial_rotary`
    if rope_type == "default":
        return theta, None
    _check_scaling(hf, rope_type, params, max_pos, rotary_dim)
    return theta, {"rope_type": rope_type, **params}


def _partial_rotary(hf: dict[str, Any], head_dim: int) -> float:
    """`partial_rotary_factor` (top level, or in transformers 5's `rope_parameters`): a share of
    each head whose rotated part must be a positive even number of dimensions."""
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    given = hf.get("partial_rotary_factor") or (rope or {}).get("partial_rotary_factor") or 1.0
    factor = _number("partial_rotary_factor", given, below=1.0 + 1e-9)
    rotated = int(head_dim * factor)
    if rotated < 2 or rotated % 2:
        raise CheckpointError(
            f"config.json: partial_rotary_factor {factor} rotates {rotated} of head_dim "
            f"{head_dim}; the rope needs a positive even number"
        )
    return factor


def _check_scaling(
    hf: dict[str, Any], rope_type: str, params: dict[str, Any], max_pos: int, rotary_dim: int
) -> None:
    """A scaled rope's parameters checked, with transformers' defaults filled in `params`."""
    if rope_type in ("llama3", "yarn", "longrope"):  # the top-level value wins, as in transformers
        original = hf.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or params.get(
            "original_max_position_embeddings", max_pos
        )
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        params["factor"] = max_pos / _number(
            "original_max_position_embeddings", params.get("original_max_position_embeddings")
        )
    missing = [key for key in _ROPE_KEYS[rope_type] if params.get(key) is None]
    if missing:
        raise CheckpointError(f"config.json: rope type {rope_type!r} needs {', '.join(missing)}")
    for key in _ROPE_KEYS[rope_type]:
        _number(f"rope {key}", params[key])
    for key in _OPTIONAL_ROPE_KEYS:
        if params.get(key) is not None:
            _number(f"rope {key}", params[key])
    if rope_type == "longrope":
        half = rotary_dim // 2
        for key in ("short_factor", "long_factor"):
            factors = params.get(key)
            if not isinstance(factors, list) or len(factors) != half:
                raise CheckpointError(
                    f"config.json: rope type 'longrope' needs {key}, a list of {half} numbers"
                )
            for value in factors:
                _number(f"rope {key}", value)


def _sliding_window(hf: dict[str, Any], family: Family, max_pos: int) -> int | None:
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types") or []
    uses_window = (
        family.sliding != "flagged"
        or _flag(hf, "use_sliding_window")
        or (isinstance(layer_types, list) and "sliding_attention" in layer_types)
    )
    if not uses_window or window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise CheckpointError("config.json: sliding_window must be a positive integer or null")
    return window if window < max_pos else None


QWEN_WINDOW_LAYERS = 28
"""`max_window_layers` where a config that slides (`use_sliding_window`) leaves it out."""


def _sliding_layers(hf: dict[str, Any], family: Family, layers: int) -> tuple[int, ...]:
    """The layers that slide the window: `layer_types` where the config lists them, else the
    family's rule (`Family.sliding`), as transformers derives `layer_types`."""
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        kinds = ("sliding_attention", "full_attention")
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise CheckpointError(f"config.json: layer_types must list each of the {layers} layers")
        if any(kind not in kinds for kind in layer_types):
            raise CheckpointError(f"config.json: layer_types may name only {' and '.join(kinds)}")
        return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if family.sliding == "flagged":  # transformers' Qwen configs default to 28
        first = _optional_int(hf, "max_window_layers")
        return tuple(range(QWEN_WINDOW_LAYERS if first is None else max(0, first), layers))
    if family.sliding.startswith("every "):
        default = int(family.sliding.removeprefix("every "))
        key = "sliding_window_pattern"
        every = next((hf[k] for k in (key, "_" + key) if hf.get(k) is not None), default)
        if not isinstance(every, int) or isinstance(every, bool) or not 1 <= every <= 1024:
            raise CheckpointError(f"config.json: {key} must be an integer from 1 to 1,024")
        return tuple(i for i in range(layers) if (i + 1) % every)
    return tuple(range(layers))


def _softcap(hf: dict[str, Any], key: str) -> float | None:
    value = hf.get(key)
    return None if value is None else _number(key, value)
